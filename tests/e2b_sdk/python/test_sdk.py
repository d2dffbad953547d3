"""The official E2B Python SDK, unmodified, against tetherd's E2B front.

Each test is named after the SDK call it judges and asserts what the SDK documents for it, so a
program written for E2B runs unchanged on tetherd. The server is found through the environment
(`E2B_API_URL`, `E2B_SANDBOX_URL`, `E2B_API_KEY`); `TETHER_E2B_OTHER_KEY` is a valid key of another
tenant and `TETHER_E2B_BAD_KEY` an invalid one. See conftest.py for bounds and teardown.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import secrets
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from datetime import datetime, timedelta, timezone
from typing import Callable, List, Optional, Set

import pytest
from e2b import (
    AuthenticationException,
    CommandExitException,
    FileNotFoundException,
    FilesystemEventType,
    FileType,
    InvalidArgumentException,
    NotFoundException,
    Sandbox,
    SandboxException,
    SandboxNotFoundException,
    SandboxNotRunningException,
    SandboxQuery,
    SandboxState,
    SandboxUnreachableException,
    TimeoutException,
)
from e2b.sandbox.filesystem.filesystem import WriteEntry
from e2b.sandbox.sandbox_api import SandboxNetworkOpts

from conftest import REQUEST_TIMEOUT_S, RUN_ID, note

HOME = "/home/user"

#: Any of the SDK's own refusals is an acceptable answer to a read outside the sandbox view.
REFUSED = (SandboxException, AuthenticationException)

sdk = pytest.mark.sdk
bound = pytest.mark.bound


# === utilities ===


def unique(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(4)}"


def bogus_sandbox_id() -> str:
    # Shaped like a real id ("i" + 20 of [a-z0-9]) so only its existence is wrong.
    return "i" + secrets.token_hex(10)


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def wait_until(predicate: Callable[[], bool], seconds: float, step: float = 0.2) -> bool:
    """Poll `predicate` until it holds or `seconds` pass; returns its last value."""
    deadline = time.monotonic() + seconds
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(step)


def list_ids(metadata: dict, api_key: Optional[str] = None) -> Set[str]:
    """All sandbox ids `Sandbox.list` returns for a metadata filter, following every page."""
    opts = {"request_timeout": REQUEST_TIMEOUT_S}
    if api_key is not None:
        opts["api_key"] = api_key
    paginator = Sandbox.list(query=SandboxQuery(metadata=metadata), **opts)
    ids: Set[str] = set()
    pages = 0
    while paginator.has_next:
        pages += 1
        assert pages <= 50, "Sandbox.list paginator never ends"
        ids.update(s.sandbox_id for s in paginator.next_items())
    return ids


def running_pids_with(sbx: Sandbox, marker: str) -> List[int]:
    return [p.pid for p in sbx.commands.list() if any(marker in a for a in p.args)]


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# === control plane ===


@sdk("Sandbox.create (metadata, envs, timeout)")
def test_sandbox_create(make_sandbox):
    sbx = make_sandbox(
        metadata={"purpose": "create", "owner": "suite"},
        envs={"TETHER_SUITE_A": "alpha beta", "TETHER_SUITE_B": "b"},
        timeout=120,
    )
    # Ids must be DNS-label safe without dashes: the `49983-<id>.<domain>` routing depends on it.
    assert re.fullmatch(r"[a-z0-9]+", sbx.sandbox_id), sbx.sandbox_id

    info = sbx.get_info()
    assert info.sandbox_id == sbx.sandbox_id
    assert {"purpose": "create", "owner": "suite", "run": RUN_ID}.items() <= info.metadata.items()
    lifetime = (info.end_at - info.started_at).total_seconds()
    assert 100 <= lifetime <= 140, f"timeout=120 gave a lifetime of {lifetime} s"

    r = sbx.commands.run('printf "%s|%s" "$TETHER_SUITE_A" "$TETHER_SUITE_B"')
    assert r.stdout == "alpha beta|b"


@sdk("Sandbox.list (metadata filter)")
def test_sandbox_list(make_sandbox):
    group = unique("grp")
    a = make_sandbox(metadata={"group": group, "role": "a", "odd": "x y&z=1/é"})
    b = make_sandbox(metadata={"group": group, "role": "b"})

    assert list_ids({"run": RUN_ID, "group": group}) == {a.sandbox_id, b.sandbox_id}
    assert list_ids({"group": group, "role": "a"}) == {a.sandbox_id}
    assert list_ids({"group": group, "role": "b"}) == {b.sandbox_id}
    # Values that need escaping survive the SDK's double encoding of the filter.
    assert list_ids({"group": group, "odd": "x y&z=1/é"}) == {a.sandbox_id}
    assert list_ids({"group": group, "role": "nobody"}) == set()

    paginator = Sandbox.list(query=SandboxQuery(metadata={"group": group, "role": "a"}))
    items = paginator.next_items()
    assert [s.sandbox_id for s in items] == [a.sandbox_id]
    listed = items[0]
    assert listed.state == SandboxState.RUNNING
    assert listed.metadata.get("role") == "a"
    assert listed.started_at <= utcnow() + timedelta(seconds=5) < listed.end_at


@sdk("Sandbox.get_info")
def test_sandbox_get_info(make_sandbox):
    sbx = make_sandbox(metadata={"k": "v"}, timeout=300)
    for info in (sbx.get_info(), Sandbox.get_info(sbx.sandbox_id)):
        assert info.sandbox_id == sbx.sandbox_id
        assert info.template_id
        assert info.metadata.get("k") == "v"
        assert info.state == SandboxState.RUNNING
        now = utcnow()
        assert info.started_at <= now + timedelta(seconds=5)
        assert info.end_at > now
        assert info.envd_version
        assert info.cpu_count >= 1
        assert info.memory_mb >= 1


@sdk("Sandbox.set_timeout")
def test_sandbox_set_timeout(make_sandbox):
    sbx = make_sandbox(timeout=300)

    sbx.set_timeout(30)
    end = sbx.get_info().end_at
    assert abs((end - utcnow()).total_seconds() - 30) <= 10, f"end_at {end} after set_timeout(30)"

    Sandbox.set_timeout(sbx.sandbox_id, 600)
    end = sbx.get_info().end_at
    assert abs((end - utcnow()).total_seconds() - 600) <= 10, f"end_at {end} after set_timeout(600)"

    # A short timeout really ends the sandbox; watched through the list, which does not touch it.
    sbx.set_timeout(2)
    gone = wait_until(lambda: sbx.sandbox_id not in list_ids({"run": RUN_ID}), 30, step=0.5)
    assert gone, "sandbox still listed 30 s after set_timeout(2)"
    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_info(sbx.sandbox_id)


@sdk("Sandbox.kill")
def test_sandbox_kill(make_sandbox):
    sbx = make_sandbox()
    assert sbx.is_running() is True
    assert sbx.kill() is True
    make_sandbox.forget(sbx.sandbox_id)

    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_info(sbx.sandbox_id)
    assert sbx.sandbox_id not in list_ids({"run": RUN_ID})
    # Killing again is not an error: the SDK documents `False` for a sandbox that is gone.
    assert Sandbox.kill(sbx.sandbox_id) is False
    assert sbx.is_running() is False


@sdk("Sandbox.connect (by id)")
def test_sandbox_connect(make_sandbox):
    sbx = make_sandbox()
    sbx.files.write(f"{HOME}/from-first.txt", "first")

    same = Sandbox.connect(sbx.sandbox_id, request_timeout=REQUEST_TIMEOUT_S)
    assert same.sandbox_id == sbx.sandbox_id
    assert same.files.read(f"{HOME}/from-first.txt") == "first"
    same.files.write(f"{HOME}/from-second.txt", "second")
    assert sbx.files.read(f"{HOME}/from-second.txt") == "second"
    assert same.commands.run("echo connected").stdout == "connected\n"


# === commands ===


@sdk("commands.run (exit 0)")
def test_commands_run_exit_zero(sandbox):
    r = sandbox.commands.run("echo hello")
    assert r.exit_code == 0
    assert r.stdout == "hello\n"
    assert r.stderr == ""


@sdk("commands.run (non-zero -> CommandExitException)")
def test_commands_run_nonzero(sandbox):
    with pytest.raises(CommandExitException) as caught:
        sandbox.commands.run("echo out; echo err >&2; exit 3")
    e = caught.value
    assert e.exit_code == 3
    assert e.stdout == "out\n"
    assert e.stderr == "err\n"
    # The sandbox is unaffected by a failing command.
    assert sandbox.commands.run("true").exit_code == 0


@sdk("commands.run (on_stdout / on_stderr)")
def test_commands_run_callbacks(sandbox):
    out: List[str] = []
    err: List[str] = []
    r = sandbox.commands.run(
        "for i in 1 2 3; do echo out$i; echo err$i >&2; sleep 0.05; done",
        on_stdout=out.append,
        on_stderr=err.append,
    )
    assert "".join(out) == "out1\nout2\nout3\n"
    assert "".join(err) == "err1\nerr2\nerr3\n"
    assert r.stdout == "".join(out)
    assert r.stderr == "".join(err)


@sdk("commands.run (envs)")
def test_commands_run_envs(make_sandbox):
    sbx = make_sandbox(envs={"TETHER_LAYER": "sandbox", "TETHER_KEEP": "kept"})
    r = sbx.commands.run(
        'printf "%s %s %s" "$TETHER_LAYER" "$TETHER_KEEP" "$TETHER_CMD"',
        envs={"TETHER_LAYER": "command", "TETHER_CMD": "with space"},
    )
    # Command envs override the sandbox's, which stay visible otherwise.
    assert r.stdout == "command kept with space"
    # And they do not leak into the next command.
    r = sbx.commands.run('printf "%s" "${TETHER_CMD-unset}"')
    assert r.stdout == "unset"


@sdk("commands.run (cwd)")
def test_commands_run_cwd(sandbox):
    assert sandbox.commands.run("pwd").stdout == f"{HOME}\n"
    target = f"{HOME}/cwd-test/sub"
    assert sandbox.files.make_dir(target) is True
    assert sandbox.commands.run("pwd", cwd=target).stdout == f"{target}\n"
    with pytest.raises(InvalidArgumentException):
        sandbox.commands.run("pwd", cwd=f"{HOME}/does-not-exist")


@sdk("commands.run (user='user' / 'root')")
def test_commands_run_user(sandbox):
    for user in ("user", "root"):
        r = sandbox.commands.run(f"echo as-{user}", user=user)
        assert r.exit_code == 0, user
        assert r.stdout == f"as-{user}\n"
    # Files API calls accept the same user selector.
    sandbox.files.write(f"{HOME}/by-user.txt", "u", user="user")
    assert sandbox.files.read(f"{HOME}/by-user.txt", user="user") == "u"


@sdk("commands.run (timeout expiry -> TimeoutException)")
def test_commands_run_timeout(sandbox):
    marker = unique("tmo")
    started = time.monotonic()
    with pytest.raises(TimeoutException) as caught:
        sandbox.commands.run(f"sleep 30; : {marker}", timeout=1)
    elapsed = time.monotonic() - started
    # Not a health-check verdict in disguise (those subclass TimeoutException too).
    assert not isinstance(caught.value, (SandboxNotRunningException, SandboxUnreachableException))
    assert elapsed < 10, f"timeout=1 took {elapsed:.1f} s"
    # E2B semantics: the command's timeout is the process's own deadline, so it is gone too.
    assert wait_until(
        lambda: not running_pids_with(sandbox, marker), 10
    ), "process survived its timeout"
    assert sandbox.commands.run("echo alive").stdout == "alive\n"


@sdk("commands.run (background) + wait")
def test_commands_run_background_wait(sandbox):
    started = time.monotonic()
    handle = sandbox.commands.run("sleep 4; echo done; echo e >&2", background=True, timeout=20)
    assert time.monotonic() - started < 3.0, "background=True waited for the command"
    assert handle.pid > 0
    result = handle.wait()
    assert result.exit_code == 0
    assert result.stdout == "done\n"
    assert result.stderr == "e\n"


@sdk("commands.run (background) + kill")
def test_commands_run_background_kill(sandbox):
    marker = unique("bgk")
    handle = sandbox.commands.run(f"sleep 30; : {marker}", background=True, timeout=20)
    assert wait_until(
        lambda: handle.pid in running_pids_with(sandbox, marker), 5
    ), "background command not listed"
    started = time.monotonic()
    assert handle.kill() is True
    with pytest.raises(CommandExitException) as caught:
        handle.wait()
    assert caught.value.exit_code != 0
    assert time.monotonic() - started < 10, "wait after kill took over 10 s"
    assert wait_until(
        lambda: not running_pids_with(sandbox, marker), 5
    ), "killed command still listed after 5 s"
    # Killing a process that is gone reports False.
    assert sandbox.commands.kill(handle.pid) is False


@sdk("commands.connect (by pid)")
def test_commands_connect(sandbox):
    handle = sandbox.commands.run(
        "sleep 2; echo after-connect; exit 4", background=True, timeout=20
    )
    handle.disconnect()
    again = sandbox.commands.connect(handle.pid, timeout=20)
    assert again.pid == handle.pid
    with pytest.raises(CommandExitException) as caught:
        again.wait()
    assert caught.value.exit_code == 4
    assert "after-connect\n" in caught.value.stdout


@sdk("commands.send_stdin (stdin=True)")
def test_commands_send_stdin(sandbox):
    handle = sandbox.commands.run(
        'read -r a; read -r b; echo "got:$a+$b"', background=True, stdin=True, timeout=20
    )
    sandbox.commands.send_stdin(handle.pid, "first\n")
    handle.send_stdin(b"second\n")
    result = handle.wait()
    assert result.stdout == "got:first+second\n"


@sdk("commands.list")
def test_commands_list(sandbox):
    marker = unique("lst")
    handle = sandbox.commands.run(f"sleep 30; : {marker}", background=True, timeout=20)
    try:
        assert wait_until(
            lambda: running_pids_with(sandbox, marker) == [handle.pid], 5
        ), "background command not listed (exactly once)"
        info = next(p for p in sandbox.commands.list() if p.pid == handle.pid)
        assert info.cmd == "/bin/bash"
        assert info.args[-1] == f"sleep 30; : {marker}"
    finally:
        handle.kill()
    assert wait_until(
        lambda: not running_pids_with(sandbox, marker), 5
    ), "killed command still listed after 5 s"


# === files ===


@sdk("files.write (str)")
def test_files_write_str(sandbox):
    path = f"{HOME}/str.txt"
    info = sandbox.files.write(path, "hello ünïcode\nline 2\n")
    assert info.path == path
    assert info.name == "str.txt"
    assert info.type == FileType.FILE
    assert sandbox.files.read(path) == "hello ünïcode\nline 2\n"
    # Overwrite truncates.
    sandbox.files.write(path, "short")
    assert sandbox.files.read(path) == "short"
    # Relative paths resolve against the user's home; parents are created.
    info = sandbox.files.write("rel/dir/relative.txt", "rel")
    assert info.path == f"{HOME}/rel/dir/relative.txt"
    assert sandbox.files.read(f"{HOME}/rel/dir/relative.txt") == "rel"


@sdk("files.write (bytes)")
def test_files_write_bytes(sandbox):
    path = f"{HOME}/blob.bin"
    data = os.urandom(200_000) + b"\x00\xff\x00"
    info = sandbox.files.write(path, data)
    assert info.path == path
    assert bytes(sandbox.files.read(path, format="bytes")) == data


@sdk("files.write (file-like / iterable stream)")
def test_files_write_stream(sandbox):
    data = os.urandom(3 * 1024 * 1024 + 17)
    # File-like objects go out as a streamed octet-stream body by default.
    sandbox.files.write(f"{HOME}/s1.bin", io.BytesIO(data))
    assert bytes(sandbox.files.read(f"{HOME}/s1.bin", format="bytes")) == data
    # An iterable of chunks, also streamed.
    chunks = (data[i : i + 65536] for i in range(0, len(data), 65536))
    sandbox.files.write(f"{HOME}/s2.bin", chunks)
    assert bytes(sandbox.files.read(f"{HOME}/s2.bin", format="bytes")) == data
    # A file-like object forced through multipart/form-data.
    sandbox.files.write(f"{HOME}/s3.bin", io.BytesIO(data), use_octet_stream=False)
    assert bytes(sandbox.files.read(f"{HOME}/s3.bin", format="bytes")) == data


@sdk("files.write_files (list of WriteEntry)")
def test_files_write_entries(sandbox):
    entries = [
        WriteEntry(path=f"{HOME}/multi/a.txt", data="A text"),
        WriteEntry(path=f"{HOME}/multi/deep/er/b.bin", data=b"\x00B\xff"),
        WriteEntry(path=f"{HOME}/multi/c.txt", data="C"),
    ]
    infos = sandbox.files.write_files(entries)
    assert sorted(i.path for i in infos) == sorted(e["path"] for e in entries)
    assert sandbox.files.read(f"{HOME}/multi/a.txt") == "A text"
    assert bytes(sandbox.files.read(f"{HOME}/multi/deep/er/b.bin", format="bytes")) == b"\x00B\xff"
    assert sandbox.files.read(f"{HOME}/multi/c.txt") == "C"

    # With a file-like entry the SDK switches to one streamed upload per file.
    infos = sandbox.files.write_files(
        [
            WriteEntry(path=f"{HOME}/multi2/x.bin", data=io.BytesIO(b"xx")),
            WriteEntry(path=f"{HOME}/multi2/y.txt", data="yy"),
        ]
    )
    assert sorted(i.path for i in infos) == [f"{HOME}/multi2/x.bin", f"{HOME}/multi2/y.txt"]
    assert sandbox.files.read(f"{HOME}/multi2/x.bin") == "xx"
    assert sandbox.files.read(f"{HOME}/multi2/y.txt") == "yy"


@sdk("files.read (format=text)")
def test_files_read_text(sandbox):
    text = "ascii, ünïcødé, 日本語, emoji 🙂\n" * 100
    sandbox.files.write(f"{HOME}/t.txt", text)
    got = sandbox.files.read(f"{HOME}/t.txt")
    assert isinstance(got, str)
    assert got == text
    # Written by a command, read by the files API: both see the same filesystem.
    sandbox.commands.run(f"printf 'from-shell' > {HOME}/shell.txt")
    assert sandbox.files.read(f"{HOME}/shell.txt", format="text") == "from-shell"


@sdk("files.read (format=bytes)")
def test_files_read_bytes(sandbox):
    data = bytes(range(256)) * 1000
    sandbox.files.write(f"{HOME}/b.bin", data)
    got = sandbox.files.read(f"{HOME}/b.bin", format="bytes")
    assert isinstance(got, bytearray)
    assert bytes(got) == data
    # An empty file reads as empty, not as an error.
    sandbox.files.write(f"{HOME}/empty.bin", b"")
    assert bytes(sandbox.files.read(f"{HOME}/empty.bin", format="bytes")) == b""


@sdk("files.read (format=stream)")
def test_files_read_stream(sandbox):
    data = os.urandom(5 * 1024 * 1024 + 3)
    sandbox.files.write(f"{HOME}/st.bin", data)
    h = hashlib.sha256()
    size = 0
    with sandbox.files.read(f"{HOME}/st.bin", format="stream") as reader:
        for chunk in reader:
            h.update(chunk)
            size += len(chunk)
    assert size == len(data)
    assert h.hexdigest() == sha256(data)


@sdk("files.list (depth)")
def test_files_list_depth(sandbox):
    root = f"{HOME}/tree"
    sandbox.files.write(f"{root}/a.txt", "12345")
    sandbox.files.write(f"{root}/d1/b.txt", "b")
    sandbox.files.write(f"{root}/d1/d2/c.txt", "c")

    one = sandbox.files.list(root)
    assert {e.path for e in one} == {f"{root}/a.txt", f"{root}/d1"}
    by_name = {e.name: e for e in one}
    assert by_name["a.txt"].type == FileType.FILE
    assert by_name["a.txt"].size == 5
    assert by_name["d1"].type == FileType.DIR

    two = sandbox.files.list(root, depth=2)
    assert {e.path for e in two} == {
        f"{root}/a.txt",
        f"{root}/d1",
        f"{root}/d1/b.txt",
        f"{root}/d1/d2",
    }
    three = sandbox.files.list(root, depth=3)
    assert f"{root}/d1/d2/c.txt" in {e.path for e in three}
    assert len(three) == 5

    with pytest.raises(NotFoundException):
        sandbox.files.list(f"{HOME}/no-such-dir")


@sdk("files.exists")
def test_files_exists(sandbox):
    sandbox.files.write(f"{HOME}/ex/here.txt", "x")
    assert sandbox.files.exists(f"{HOME}/ex/here.txt") is True
    assert sandbox.files.exists(f"{HOME}/ex") is True
    assert sandbox.files.exists(f"{HOME}/ex/missing.txt") is False
    assert sandbox.files.exists(f"{HOME}/nope/missing.txt") is False


@sdk("files.get_info")
def test_files_get_info(sandbox):
    path = f"{HOME}/info/file.txt"
    sandbox.files.write(path, "0123456789")
    info = sandbox.files.get_info(path)
    assert info.name == "file.txt"
    assert info.path == path
    assert info.type == FileType.FILE
    assert info.size == 10
    assert abs((info.modified_time - utcnow()).total_seconds()) < 300
    d = sandbox.files.get_info(f"{HOME}/info")
    assert d.type == FileType.DIR
    assert d.name == "info"
    with pytest.raises(NotFoundException):
        sandbox.files.get_info(f"{HOME}/info/missing")


@sdk("files.make_dir")
def test_files_make_dir(sandbox):
    assert sandbox.files.make_dir(f"{HOME}/mk") is True
    assert sandbox.files.make_dir(f"{HOME}/mk") is False
    assert sandbox.files.make_dir(f"{HOME}/mk/a/b/c") is True
    assert sandbox.files.get_info(f"{HOME}/mk/a/b").type == FileType.DIR
    r = sandbox.commands.run(f"test -d {HOME}/mk/a/b/c && echo dir")
    assert r.stdout == "dir\n"


@sdk("files.rename")
def test_files_rename(sandbox):
    sandbox.files.write(f"{HOME}/old.txt", "content")
    info = sandbox.files.rename(f"{HOME}/old.txt", f"{HOME}/new.txt")
    assert info.path == f"{HOME}/new.txt"
    assert info.name == "new.txt"
    assert sandbox.files.exists(f"{HOME}/old.txt") is False
    assert sandbox.files.read(f"{HOME}/new.txt") == "content"
    # Directories move with their contents.
    sandbox.files.write(f"{HOME}/dold/inner.txt", "in")
    sandbox.files.rename(f"{HOME}/dold", f"{HOME}/dnew")
    assert sandbox.files.read(f"{HOME}/dnew/inner.txt") == "in"
    assert sandbox.files.exists(f"{HOME}/dold") is False
    with pytest.raises(NotFoundException):
        sandbox.files.rename(f"{HOME}/never.txt", f"{HOME}/x.txt")


@sdk("files.remove")
def test_files_remove(sandbox):
    sandbox.files.write(f"{HOME}/rm.txt", "x")
    sandbox.files.remove(f"{HOME}/rm.txt")
    assert sandbox.files.exists(f"{HOME}/rm.txt") is False
    sandbox.files.write(f"{HOME}/rmdir/a/b.txt", "x")
    sandbox.files.remove(f"{HOME}/rmdir")
    assert sandbox.files.exists(f"{HOME}/rmdir") is False
    assert sandbox.commands.run(f"test -e {HOME}/rmdir || echo gone").stdout == "gone\n"


@sdk("files.watch_dir")
def test_files_watch_dir(sandbox):
    watched = f"{HOME}/watched"
    sandbox.files.make_dir(watched)
    handle = sandbox.files.watch_dir(watched)
    seen: list = []

    def saw(name: str, kinds: set) -> Callable[[], bool]:
        def check() -> bool:
            seen.extend(handle.get_new_events())
            return any(e.name == name and e.type in kinds for e in seen)

        return check

    try:
        sandbox.files.write(f"{watched}/new-file.txt", "hello")
        assert wait_until(
            saw("new-file.txt", {FilesystemEventType.CREATE}), 10
        ), f"no CREATE event for new-file.txt; got {seen}"
        # A file created by a process inside the sandbox is seen too.
        sandbox.commands.run(f"echo x > {watched}/by-shell.txt")
        kinds = {FilesystemEventType.CREATE, FilesystemEventType.WRITE}
        assert wait_until(saw("by-shell.txt", kinds), 10), f"no event for by-shell.txt; got {seen}"
    finally:
        handle.stop()
    with pytest.raises(SandboxException):
        handle.get_new_events()


@sdk("files 64 MiB round trip (sha256)")
@bound(300)
def test_files_64mib_roundtrip(sandbox):
    size = 64 * 1024 * 1024
    data = os.urandom(size)
    digest = sha256(data)
    path = f"{HOME}/big.bin"

    t0 = time.monotonic()
    sandbox.files.write(path, io.BytesIO(data))
    t_write = time.monotonic() - t0
    assert sandbox.files.get_info(path).size == size

    # What landed in the sandbox is byte-exact, as seen from inside.
    r = sandbox.commands.run(f"sha256sum {path}", timeout=120)
    assert r.stdout.split()[0] == digest

    t0 = time.monotonic()
    h = hashlib.sha256()
    got = 0
    with sandbox.files.read(path, format="stream") as reader:
        for chunk in reader:
            h.update(chunk)
            got += len(chunk)
    t_read = time.monotonic() - t0
    assert got == size
    assert h.hexdigest() == digest

    t0 = time.monotonic()
    whole = sandbox.files.read(path, format="bytes", request_timeout=120)
    t_bytes = time.monotonic() - t0
    assert len(whole) == size
    assert sha256(bytes(whole)) == digest
    note(
        f"64 MiB: write {size / t_write / 2**20:.0f} MiB/s ({t_write:.2f} s), "
        f"streamed read {size / t_read / 2**20:.0f} MiB/s ({t_read:.2f} s), "
        f"bytes read {size / t_bytes / 2**20:.0f} MiB/s ({t_bytes:.2f} s)"
    )


# === errors, auth and isolation ===


@sdk("files.read missing -> NotFoundException")
def test_files_read_missing(sandbox):
    with pytest.raises(NotFoundException) as caught:
        sandbox.files.read(f"{HOME}/definitely-missing.txt")
    assert isinstance(caught.value, FileNotFoundException)
    with pytest.raises(NotFoundException):
        sandbox.files.read(f"{HOME}/missing-dir/x.bin", format="bytes")


@sdk("missing sandbox: connect/kill/get_info/set_timeout")
def test_missing_sandbox(env):
    bogus = bogus_sandbox_id()
    with pytest.raises(SandboxNotFoundException):
        Sandbox.connect(bogus, request_timeout=REQUEST_TIMEOUT_S)
    assert Sandbox.kill(bogus) is False
    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_info(bogus)
    with pytest.raises(SandboxNotFoundException):
        Sandbox.set_timeout(bogus, 60)


@sdk("bad API key -> AuthenticationException")
def test_bad_key(env, sandbox):
    bad = env.bad_key
    with pytest.raises(AuthenticationException):
        Sandbox.create(api_key=bad, request_timeout=REQUEST_TIMEOUT_S)
    with pytest.raises(AuthenticationException):
        Sandbox.list(api_key=bad).next_items()
    # Authentication comes before any lookup: an existing id does not change the answer.
    with pytest.raises(AuthenticationException):
        Sandbox.get_info(sandbox.sandbox_id, api_key=bad)
    with pytest.raises(AuthenticationException):
        Sandbox.kill(sandbox.sandbox_id, api_key=bad)
    with pytest.raises(AuthenticationException):
        Sandbox.connect(sandbox.sandbox_id, api_key=bad)
    assert sandbox.commands.run("echo still-here").stdout == "still-here\n"


@sdk("other tenant's sandbox -> not visible")
def test_other_tenant(env, make_sandbox):
    mine = make_sandbox(metadata={"tenant": "main"})
    theirs = make_sandbox(api_key=env.other_key, metadata={"tenant": "other"})
    other = env.other_key

    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_info(mine.sandbox_id, api_key=other)
    with pytest.raises(SandboxNotFoundException):
        Sandbox.connect(mine.sandbox_id, api_key=other, request_timeout=REQUEST_TIMEOUT_S)
    with pytest.raises(SandboxNotFoundException):
        Sandbox.set_timeout(mine.sandbox_id, 5, api_key=other)
    assert Sandbox.kill(mine.sandbox_id, api_key=other) is False

    assert list_ids({"run": RUN_ID}, api_key=other) == {theirs.sandbox_id}
    assert theirs.sandbox_id not in list_ids({"run": RUN_ID})
    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_info(theirs.sandbox_id)

    # None of that touched the owner's sandbox.
    assert mine.commands.run("echo mine").stdout == "mine\n"
    assert mine.get_info().end_at > utcnow() + timedelta(seconds=30)


def _raw_envd(
    env, sandbox_id: str, method: str, path: str, token: Optional[str], body: bytes = b""
):
    """One envd request with hand-set headers; returns the HTTP status."""
    headers = {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": "49983"}
    if token is not None:
        headers["X-Access-Token"] = token
    if method == "POST":
        headers["Content-Type"] = "application/json"
        headers["Connect-Protocol-Version"] = "1"
    req = urllib.request.Request(
        env.sandbox_url.rstrip("/") + path, data=body or None, method=method, headers=headers
    )
    try:
        with urllib.request.urlopen(req, timeout=15) as resp:
            resp.read()
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


@sdk("envd X-Access-Token enforced (raw HTTP)")
def test_envd_access_token(env, make_sandbox):
    a = make_sandbox()
    b = make_sandbox()
    token_a = a._envd_access_token
    token_b = b._envd_access_token
    assert token_a, "create must issue an envdAccessToken"
    assert token_a != token_b
    a.files.write(f"{HOME}/secret.txt", "a-secret")
    list_body = json.dumps({"path": HOME, "depth": 1}).encode()
    rpc = "/filesystem.Filesystem/ListDir"

    assert _raw_envd(env, a.sandbox_id, "POST", rpc, token_a, list_body) == 200
    assert _raw_envd(env, a.sandbox_id, "POST", rpc, None, list_body) == 401
    assert _raw_envd(env, a.sandbox_id, "POST", rpc, "wrong-token", list_body) == 401
    assert _raw_envd(env, a.sandbox_id, "POST", rpc, token_b, list_body) == 401
    files = "/files?path=" + urllib.request.quote(f"{HOME}/secret.txt")
    assert _raw_envd(env, a.sandbox_id, "GET", files, token_a) == 200
    # Without a token a read needs a valid signature; with none it is refused.
    assert _raw_envd(env, a.sandbox_id, "GET", files, None) == 401
    assert _raw_envd(env, a.sandbox_id, "GET", files, token_b) == 401


@sdk("path escape (/etc/shadow, ../../etc/passwd)")
def test_path_escape(sandbox):
    # 1. /etc/shadow is not readable in the sandbox view; it must never come back as host content.
    host_shadow = None
    try:
        with open("/etc/shadow", "rb") as f:
            host_shadow = f.read()
    except OSError:
        pass
    try:
        got = bytes(sandbox.files.read("/etc/shadow", format="bytes"))
    except REFUSED:
        got = None
    if got is not None and host_shadow:
        assert got != host_shadow, "files.read('/etc/shadow') returned the host's /etc/shadow"
        for line in host_shadow.splitlines():
            fields = line.split(b":")
            if len(fields) > 2 and len(fields[1]) > 4:  # a real password hash
                assert fields[1] not in got, "a host password hash leaked through files.read"

    # 2. Relative traversal resolves inside the sandbox: the files API sees exactly what the
    #    sandbox's own processes see at that path, never more.
    for rel in ("../../etc/passwd", "../../../../../../../../etc/passwd"):
        try:
            via_files: Optional[str] = sandbox.files.read(rel)
        except REFUSED:
            via_files = None
        try:
            via_shell: Optional[str] = sandbox.commands.run("cat /etc/passwd").stdout
        except CommandExitException:
            via_shell = None
        if via_files is not None:
            assert via_files == via_shell, f"files.read({rel!r}) differs from the sandbox's view"


@sdk("sandbox isolation (host file out of reach)")
def test_sandbox_isolation_host_file(sandbox):
    # A file that exists only on the host, outside any sandbox, is out of reach of the files API by
    # any path, and of the sandbox's own processes.
    canary_dir = tempfile.mkdtemp(prefix="tether-e2b-canary-")
    canary = os.path.join(canary_dir, "canary.txt")
    secret = "host-only-" + secrets.token_hex(16)
    with open(canary, "w") as f:
        f.write(secret)
    try:
        for p in (canary, "../../../../../../../.." + canary):
            try:
                content = sandbox.files.read(p)
            except REFUSED:
                continue
            assert secret not in content, f"files.read({p!r}) returned a host file"
        r = sandbox.commands.run(f"cat {canary} 2>/dev/null || true")
        assert secret not in r.stdout, "a sandboxed process read a host file"
    finally:
        os.unlink(canary)
        os.rmdir(canary_dir)


# === envd fidelity (what envd itself answers, where a guess would differ) ===


@sdk("commands.run: E2B_SANDBOX / E2B_SANDBOX_ID / E2B_TEMPLATE_ID and /run/e2b")
def test_sandbox_markers(sandbox):
    # What E2B gives every sandbox: programs read them to learn they run in one, and which.
    r = sandbox.commands.run('echo "$E2B_SANDBOX $E2B_SANDBOX_ID $E2B_TEMPLATE_ID"')
    assert r.stdout == f"true {sandbox.sandbox_id} base\n"
    r = sandbox.commands.run(
        "cat /run/e2b/.E2B_SANDBOX; echo; cat /run/e2b/.E2B_SANDBOX_ID; echo; cat /run/e2b/.E2B_TEMPLATE_ID"
    )
    assert r.stdout == f"true\n{sandbox.sandbox_id}\nbase"
    # A command's own value wins.
    assert sandbox.commands.run('echo "$E2B_SANDBOX"', envs={"E2B_SANDBOX": "mine"}).stdout == "mine\n"


@sdk("commands.kill (the process is gone when kill answers)")
def test_commands_kill_then_gone(sandbox):
    # envd reaps its child at once: a program that kills a process and looks for it at
    # once finds nothing, not a zombie awaiting its reaper. Busy processes beside it make
    # a late reaper show.
    for _ in range(2):
        sandbox.commands.run("exec timeout 60 sh -c 'while :; do :; done'", background=True)
    for _ in range(10):
        handle = sandbox.commands.run("sleep 10", background=True)
        assert sandbox.commands.kill(handle.pid) is True
        with pytest.raises(CommandExitException):
            sandbox.commands.run(f"kill -0 {handle.pid}")



@sdk("files.* with user='root', and envd's rights for every user")
def test_files_as_root_and_envds_rights(sandbox):
    # As root: /root, private to root; relative paths start there.
    info = sandbox.files.write("/root/secret.txt", "s3cret", user="root")
    assert info.path == "/root/secret.txt"
    assert sandbox.files.read("/root/secret.txt", user="root") == "s3cret"
    assert sandbox.files.write("rel.txt", "r", user="root").path == "/root/rel.txt"
    r = sandbox.commands.run("stat -c %U:%G:%a /root/secret.txt /root/rel.txt", user="root")
    assert r.stdout == "root:root:644\nroot:root:644\n"
    # The user's own commands still cannot enter /root.
    with pytest.raises(CommandExitException):
        sandbox.commands.run("cat /root/secret.txt")
    # envd acts with root's rights for every user and gives what it creates to that user: a
    # file in root's /etc, a new tree at the top of the file system.
    sandbox.files.write("/etc/app.conf", "conf")
    sandbox.files.write("/0/a/b.txt", "deep")
    r = sandbox.commands.run("stat -c %U:%G /etc/app.conf /0 /0/a /0/a/b.txt")
    assert r.stdout == "user:user\n" * 4
    assert sandbox.files.read("/0/a/b.txt") == "deep"
    # The rest of the files API, as root.
    assert sandbox.files.make_dir("/root/d/e", user="root")
    assert sandbox.files.exists("/root/d/e", user="root")
    assert "d" in [e.name for e in sandbox.files.list("/root", user="root")]
    moved = sandbox.files.rename("/root/secret.txt", "/root/d/moved.txt", user="root")
    assert moved.path == "/root/d/moved.txt"
    assert sandbox.files.get_info("/root/d/moved.txt", user="root").size == 6
    sandbox.files.remove("/root/d", user="root")
    assert not sandbox.files.exists("/root/d", user="root")
    # A signed upload URL for root lands in root's home.
    url = sandbox.upload_url("hello.txt", user="root")
    boundary = "tether" + secrets.token_hex(8)
    body = (
        f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"hello.txt\"\r\n"
        f"Content-Type: application/octet-stream\r\n\r\nsigned hello\r\n--{boundary}--\r\n"
    ).encode()
    req = urllib.request.Request(url, data=body, method="POST")
    req.add_header("Content-Type", f"multipart/form-data; boundary={boundary}")
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as resp:
        assert resp.status == 200
    assert sandbox.files.read("/root/hello.txt", user="root") == "signed hello"
    assert not sandbox.files.exists(f"{HOME}/hello.txt")



@sdk("files.remove (missing path: success, as os.RemoveAll)")
def test_files_remove_missing(sandbox):
    sandbox.files.remove(f"{HOME}/{unique('never-there')}")
    sandbox.files.remove(unique("relative-never-there"))
    sandbox.files.remove(f"{HOME}/{unique('no-dir')}/below/file.txt")


@sdk("files.get_info / files.list (symlink: target's mode, absolute target)")
def test_files_symlink_entries(sandbox):
    # envd describes a link by its final target (mode, resolved absolute path) and marks it
    # `is_symlink`, which this SDK reports as type SYMLINK; an entry that is not a link has none.
    d = f"{HOME}/{unique('links')}"
    sandbox.files.write(f"{d}/target.txt", "pointed at")
    sandbox.files.make_dir(f"{d}/sub")
    sandbox.commands.run(
        f"cd {d} && chmod 600 target.txt && ln -s target.txt file-link"
        f" && ln -s sub dir-link && ln -s file-link chain-link"
    )
    link = sandbox.files.get_info(f"{d}/file-link")
    assert link.name == "file-link"
    assert link.path == f"{d}/file-link"
    assert link.type == FileType.SYMLINK
    assert link.mode == 0o600
    assert link.symlink_target == f"{d}/target.txt"
    chain = sandbox.files.get_info(f"{d}/chain-link")
    assert (chain.mode, chain.symlink_target) == (0o600, f"{d}/target.txt")
    dlink = sandbox.files.get_info(f"{d}/dir-link")
    assert dlink.mode == 0o755
    assert dlink.symlink_target == f"{d}/sub"
    listed = {e.name: e for e in sandbox.files.list(d)}
    assert listed["file-link"].symlink_target == f"{d}/target.txt"
    assert listed["file-link"].mode == 0o600
    assert listed["target.txt"].type == FileType.FILE
    assert listed["target.txt"].symlink_target is None
    assert listed["sub"].type == FileType.DIR


@sdk("download_url (expired signature -> envd's 401)")
def test_download_url_expired_signature(make_sandbox):
    sbx = make_sandbox(secure=True)
    path = f"{HOME}/signed.txt"
    sbx.files.write(path, "signed content")
    expired = sbx.download_url(path, "user", use_signature_expiration=-120)
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(expired, timeout=REQUEST_TIMEOUT_S)
    assert caught.value.code == 401
    body = json.loads(caught.value.read().decode())
    assert body == {"code": 401, "message": "signature is already expired"}
    in_force = sbx.download_url(path, "user", use_signature_expiration=120)
    with urllib.request.urlopen(in_force, timeout=REQUEST_TIMEOUT_S) as resp:
        assert resp.read() == b"signed content"


@sdk("files.watch_dir (upload of a new file: CREATE, CHMOD, WRITE)")
def test_files_watch_upload_events(sandbox):
    watched = f"{HOME}/{unique('watch-up')}"
    sandbox.files.make_dir(watched)
    handle = sandbox.files.watch_dir(watched)
    try:
        sandbox.files.write(f"{watched}/uploaded.txt", "payload")
        # As envd: the three events are there as soon as the upload is answered.
        events = [e for e in handle.get_new_events() if e.name == "uploaded.txt"]
        assert [e.type for e in events[:3]] == [
            FilesystemEventType.CREATE,
            FilesystemEventType.CHMOD,
            FilesystemEventType.WRITE,
        ], f"got {events}"
    finally:
        handle.stop()


@sdk("commands.run (background) timeout -> TimeoutException on wait")
def test_commands_background_timeout(sandbox):
    marker = unique("bgto")
    handle = sandbox.commands.run(f"sleep 30; : {marker}", background=True, timeout=2)
    started = time.monotonic()
    # envd ends the stream with the call's deadline_exceeded, not with the killed process's end.
    with pytest.raises(TimeoutException) as caught:
        handle.wait()
    assert not isinstance(caught.value, (SandboxNotRunningException, SandboxUnreachableException))
    assert time.monotonic() - started < 10
    assert wait_until(lambda: not running_pids_with(sandbox, marker), 10)


@sdk("Sandbox.kill under a running command -> 'sandbox was killed'")
def test_kill_under_running_command(make_sandbox):
    sbx = make_sandbox()
    handle = sbx.commands.run("sleep 60", background=True)
    assert sbx.kill() is True
    make_sandbox.forget(sbx.sandbox_id)
    with pytest.raises(SandboxException) as caught:
        handle.wait()
    assert "sandbox was killed or reached its end of life" in str(caught.value)


@sdk("Sandbox.create (unknown template -> E2B's 404)")
def test_sandbox_create_unknown_template(env):
    name = unique("no-such-template")
    with pytest.raises(SandboxException) as caught:
        Sandbox.create(name, request_timeout=REQUEST_TIMEOUT_S)
    assert getattr(caught.value, "status_code", None) == 404
    assert f"template '{name}' not found" in str(caught.value)


@sdk("files.write metadata (kept as user.e2b.* xattrs)")
def test_files_metadata_is_xattrs(sandbox):
    p = f"{HOME}/{unique('meta')}.txt"
    meta = {"author": "suite", "purpose": "upload"}
    assert sandbox.files.write(p, "first", metadata=meta).metadata == meta
    assert sandbox.files.get_info(p).metadata == meta
    # On the file itself, as the sandbox's own processes see it.
    r = sandbox.commands.run(
        f"python3 -c \"import os; print(os.getxattr('{p}', 'user.e2b.author').decode())\""
    )
    assert r.stdout == "suite\n"
    # Set inside the sandbox: shown as metadata, in get_info and in list.
    q = f"{HOME}/{unique('meta-set')}.txt"
    sandbox.files.write(q, "content")
    assert sandbox.files.get_info(q).metadata is None
    sandbox.commands.run(f"python3 -c \"import os; os.setxattr('{q}', 'user.e2b.author', b'mish')\"")
    assert sandbox.files.get_info(q).metadata == {"author": "mish"}
    listed = {e.path: e for e in sandbox.files.list(HOME)}
    assert listed[q].metadata == {"author": "mish"}
    # Overwriting without metadata clears what an earlier upload stored.
    sandbox.files.write(p, "second")
    assert sandbox.files.get_info(p).metadata is None


@sdk("Sandbox.get_metrics (instance and static, range)")
def test_sandbox_get_metrics(make_sandbox):
    sbx = make_sandbox()
    sbx.commands.run(
        "head -c 30000000 /dev/urandom | sha256sum > /dev/null; head -c 8000000 /dev/urandom > /tmp/m.bin; sync"
    )
    metrics = sbx.get_metrics()
    assert len(metrics) == 1, metrics
    m = metrics[0]
    assert m.cpu_count >= 1
    assert 0 < m.cpu_used_pct <= 100, m
    assert 0 < m.mem_used <= m.mem_total, m
    # A VM's disk use is its image's allocation on the host, which lags what the guest
    # wrote: only a local sandbox's is exact.
    assert 0 < m.disk_used <= m.disk_total, m
    assert abs((m.timestamp - utcnow()).total_seconds()) < 60, m
    again = Sandbox.get_metrics(sbx.sandbox_id)
    assert len(again) == 1 and again[0].timestamp >= m.timestamp
    # A range that ended an hour ago holds no sample.
    assert Sandbox.get_metrics(sbx.sandbox_id, end=utcnow() - timedelta(hours=1)) == []
    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_metrics(bogus_sandbox_id())


#: A server that answers any request with `101` and then echoes what it reads, upper-cased:
#: an upgraded connection (what a WebSocket is to a proxy) through the port proxy.
UPGRADE_ECHO = r"""
import socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 8081))
s.listen()
while True:
    c, _ = s.accept()
    data = b""
    while b"\r\n\r\n" not in data:
        data += c.recv(4096)
    c.sendall(b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: echo\r\n\r\n")
    rest = data.split(b"\r\n\r\n", 1)[1]
    while True:
        if rest:
            c.sendall(rest.upper())
        rest = c.recv(4096)
        if not rest:
            break
    c.close()
"""


def _front_request(host: str, path: str = "/", headers: Optional[dict] = None) -> "tuple[int, bytes]":
    import http.client

    front = urllib.parse.urlsplit(os.environ["E2B_API_URL"])
    conn = http.client.HTTPConnection(front.hostname, front.port, timeout=REQUEST_TIMEOUT_S)
    try:
        conn.request("GET", path, headers={"Host": host, **(headers or {})})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


@sdk("Sandbox.create(network={'https_ports': [...]}) (the proxy speaks TLS to those ports)")
def test_https_ports_are_reached_over_tls(env, make_sandbox):
    if not os.environ.get("TETHER_SUITE_PORTS"):
        pytest.skip("the provider of this run does not reach sandbox ports")
    sbx = make_sandbox(network={"https_ports": [8443]})
    info = sbx.get_info()
    assert info.network is not None and info.network.get("https_ports") == [8443], info.network
    assert info.network.get("allow_public_traffic") is True, info.network
    # A server with a self-signed certificate, on the listed port and on one that is not.
    sbx.files.write("/tmp/tls/hello.txt", "hello over tls")
    sbx.files.write(
        "/tmp/tls/serve.py",
        "import http.server, ssl, sys, os\n"
        "os.chdir('/tmp/tls')\n"
        "ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)\n"
        "ctx.load_cert_chain('/tmp/tls/c.pem', '/tmp/tls/k.pem')\n"
        "srv = http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), http.server.SimpleHTTPRequestHandler)\n"
        "srv.socket = ctx.wrap_socket(srv.socket, server_side=True)\n"
        "srv.serve_forever()\n",
    )
    sbx.commands.run(
        "cd /tmp/tls && openssl req -x509 -newkey rsa:2048 -nodes -subj /CN=localhost"
        " -keyout k.pem -out c.pem -days 1 2>/dev/null"
    )
    sbx.commands.run("exec python3 /tmp/tls/serve.py 8443", background=True)
    sbx.commands.run("exec python3 /tmp/tls/serve.py 9443", background=True)
    deadline = time.monotonic() + 20
    while True:
        status, body = _front_request(sbx.get_host(8443), "/hello.txt")
        if status == 200:
            break
        assert status == 502, (status, body)
        assert time.monotonic() < deadline, "the TLS server never came up"
        time.sleep(0.2)
    assert body == b"hello over tls"
    # A port not listed is spoken to in plain HTTP: the TLS server does not answer it.
    status, body = _front_request(sbx.get_host(9443), "/hello.txt")
    assert status != 200 and b"hello over tls" not in body, (status, body)
    # envd's port cannot be listed.
    with pytest.raises(SandboxException):
        make_sandbox(network={"https_ports": [49983]})


@sdk("Sandbox.get_host (the port proxy: HTTP, an upgraded connection, a closed port)")
def test_get_host_reaches_servers_in_the_sandbox(env, make_sandbox):
    import socket

    if not os.environ.get("TETHER_SUITE_PORTS"):
        pytest.skip("the provider of this run does not reach sandbox ports")
    sbx = make_sandbox()
    sbx.files.write("/tmp/www/hello.txt", "hello from the sandbox")
    sbx.files.write("/tmp/echo.py", UPGRADE_ECHO)
    sbx.commands.run("cd /tmp/www && exec python3 -m http.server 8080 --bind 127.0.0.1", background=True)
    sbx.commands.run("exec python3 /tmp/echo.py", background=True)
    host = sbx.get_host(8080)
    assert host.startswith(f"8080-{sbx.sandbox_id}."), host
    deadline = time.monotonic() + 20
    while True:
        status, body = _front_request(host, "/hello.txt")
        if status == 200:
            break
        # E2B's answer while nothing listens yet.
        assert status == 502 and b"port is not open" in body, (status, body)
        assert time.monotonic() < deadline, "the server never came up"
        time.sleep(0.2)
    assert body == b"hello from the sandbox"
    # Another sandbox's same port is its own: each host reaches its own sandbox's server.
    other = make_sandbox()
    other.files.write("/tmp/www/hello.txt", "hello from the other one")
    other.commands.run("cd /tmp/www && exec python3 -m http.server 8080 --bind 127.0.0.1", background=True)
    while True:
        status, other_body = _front_request(other.get_host(8080), "/hello.txt")
        if status == 200:
            break
        assert status == 502 and time.monotonic() < deadline + 20, (status, other_body)
        time.sleep(0.2)
    assert other_body == b"hello from the other one"
    assert _front_request(host, "/hello.txt") == (200, b"hello from the sandbox")
    # A port nothing listens on, and a sandbox that does not exist.
    status, body = _front_request(sbx.get_host(9))
    closed = json.loads(body)
    assert status == 502 and closed["message"] == "The sandbox is running but port is not open", closed
    assert (closed["sandboxId"], closed["port"]) == (sbx.sandbox_id, 9), closed
    # A browser gets E2B's page instead.
    browser = {"User-Agent": "Mozilla/5.0 (X11; Linux x86_64) AppleWebKit/537.36 Chrome/120.0 Safari/537.36"}
    status, body = _front_request(sbx.get_host(9), "/", headers=browser)
    assert status == 502 and b"<title>Closed Port Error</title>" in body, (status, body)
    status, body = _front_request(f"8080-{bogus_sandbox_id()}.{host.split('.', 1)[1]}")
    assert status == 502 and json.loads(body)["message"] == "The sandbox was not found"
    # An upgraded connection carries bytes both ways.
    front = urllib.parse.urlsplit(os.environ["E2B_API_URL"])
    up = sbx.get_host(8081)
    while True:
        s = socket.create_connection((front.hostname, front.port), timeout=REQUEST_TIMEOUT_S)
        s.sendall(f"GET /ws HTTP/1.1\r\nHost: {up}\r\nConnection: Upgrade\r\nUpgrade: echo\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = s.recv(4096)
            assert chunk, head
            head += chunk
        if head.startswith(b"HTTP/1.1 101"):
            break
        s.close()
        assert b" 502 " in head.split(b"\r\n", 1)[0], head
        assert time.monotonic() < deadline + 20, "the upgrade server never came up"
        time.sleep(0.2)
    s.sendall(b"ping")
    got = b""
    while len(got) < 4:
        got += s.recv(16)
    assert got == b"PING"
    s.close()


#: A server on port 8080 that answers every GET with the `Host` header it was sent.
HOST_ECHO = r"""
import http.server
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = self.headers.get("Host", "").encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", 8080), H).serve_forever()
"""


@sdk("Sandbox.create(network=...): private ports with a traffic token, a masked host, egress rules enforced or refused")
def test_network_private_ports_and_masked_host(env, make_sandbox):
    if not os.environ.get("TETHER_SUITE_PORTS"):
        pytest.skip("the provider of this run does not reach sandbox ports")
    sbx = make_sandbox(
        network=SandboxNetworkOpts(allow_public_traffic=False, mask_request_host="localhost:${PORT}")
    )
    token = sbx.traffic_access_token
    assert token, "a sandbox with private ports has a traffic access token"
    sbx.files.write("/tmp/host_echo.py", HOST_ECHO)
    sbx.commands.run("exec python3 /tmp/host_echo.py", background=True)
    host = sbx.get_host(8080)
    # Without the token, or with another one: refused before the sandbox is reached.
    assert _front_request(host)[0] == 403
    assert _front_request(host, headers={"e2b-traffic-access-token": "0" * len(token)})[0] == 403
    deadline = time.monotonic() + 20
    while True:
        status, body = _front_request(host, headers={"e2b-traffic-access-token": token})
        if status == 200:
            break
        assert status == 502 and time.monotonic() < deadline, (status, body)
        time.sleep(0.2)
    # The server sees the masked host, not the proxy's.
    assert body == b"localhost:8080"
    # A sandbox with public ports has no traffic token.
    assert make_sandbox().traffic_access_token is None
    # A rule is enforced or refused, never dropped: a host name is refused everywhere.
    with pytest.raises(SandboxException) as err:
        make_sandbox(network=SandboxNetworkOpts(deny_out=["example.com"]))
    assert "denyOut" in str(err.value)
    if not os.environ.get("TETHER_SUITE_EGRESS"):
        # A provider that cannot enforce networks' rules refuses them.
        with pytest.raises(SandboxException):
            make_sandbox(network=SandboxNetworkOpts(deny_out=["10.255.255.1/32"]))
        return
    # Where enforced, a denied network is refused at once inside the sandbox (nothing
    # leaves it), and `allow_out` wins over `deny_out`.
    ruled = make_sandbox(
        network=SandboxNetworkOpts(deny_out=["10.255.255.0/24"], allow_out=["10.255.255.2"])
    )
    started = time.monotonic()
    r = ruled.commands.run(
        "timeout 5 bash -c 'exec 3<>/dev/tcp/10.255.255.1/80'; echo $?", request_timeout=REQUEST_TIMEOUT_S
    )
    assert r.stdout.strip().splitlines()[-1] == "1", r.stdout + r.stderr
    assert time.monotonic() - started < 4


@sdk("Sandbox.update_network: a running sandbox's egress rules replaced whole, enforced at once, lifted again")
def test_update_network_replaces_a_running_sandboxs_rules(env, make_sandbox):
    sbx = make_sandbox()
    # A rule is enforced or refused, never dropped: a host name is refused everywhere.
    with pytest.raises(SandboxException) as err:
        sbx.update_network({"deny_out": ["example.com"]})
    assert "denyOut" in str(err.value)
    if not os.environ.get("TETHER_SUITE_EGRESS"):
        # A provider that cannot change them on a running sandbox says so.
        with pytest.raises(SandboxException):
            sbx.update_network({"deny_out": ["10.255.255.1/32"]})
        return
    probe = "timeout 5 bash -c 'exec 3<>/dev/tcp/10.255.255.1/80'; echo $?"
    # No internet but what `allow_out` names: a denied network is refused at once,
    # inside the sandbox (nothing leaves it), by the command started after the change.
    sbx.update_network({"allow_internet_access": False, "allow_out": ["10.255.255.2"]})
    started = time.monotonic()
    r = sbx.commands.run(probe, request_timeout=REQUEST_TIMEOUT_S)
    assert r.stdout.strip().splitlines()[-1] == "1", r.stdout + r.stderr
    assert time.monotonic() - started < 4
    # The class-method form, by id, replaces them too (here: the same rule, by network).
    Sandbox.update_network(sbx.sandbox_id, {"deny_out": ["10.255.255.0/24"]})
    r = sbx.commands.run(probe, request_timeout=REQUEST_TIMEOUT_S)
    assert r.stdout.strip().splitlines()[-1] == "1", r.stdout + r.stderr
    # An empty update lifts every rule; another tenant's sandbox is not found.
    sbx.update_network({})
    with pytest.raises(SandboxNotFoundException):
        Sandbox.update_network(sbx.sandbox_id, {}, api_key=os.environ["TETHER_E2B_OTHER_KEY"])


def _require_snapshots() -> None:
    if not os.environ.get("TETHER_SUITE_SNAPSHOTS"):
        pytest.skip("the provider of this run takes no snapshots")


@sdk("Sandbox.create_snapshot / list_snapshots / delete_snapshot")
@bound(180)
def test_snapshots_are_listed_filtered_and_deleted_once(env, make_sandbox):
    _require_snapshots()
    sbx = make_sandbox()
    name = unique("snap")
    named = sbx.create_snapshot(name=name)
    assert named.snapshot_id and any(name in n for n in named.names), named
    unnamed = Sandbox.create_snapshot(sbx.sandbox_id)
    assert unnamed.snapshot_id and unnamed.snapshot_id != named.snapshot_id
    try:
        every = Sandbox.list_snapshots()
        assert every.has_next
        listed = {s.snapshot_id for s in every.next_items()}
        assert {named.snapshot_id, unnamed.snapshot_id} <= listed
        of_sandbox = Sandbox.list_snapshots(sandbox_id=sbx.sandbox_id).next_items()
        assert {s.snapshot_id for s in of_sandbox} == {named.snapshot_id, unnamed.snapshot_id}
        by_name = Sandbox.list_snapshots(name=name).next_items()
        assert [s.snapshot_id for s in by_name] == [named.snapshot_id]
        assert Sandbox.list_snapshots(name=f"{name}-does-not-exist").next_items() == []
        # Pages of one follow the server's cursor to the end.
        pages, seen = Sandbox.list_snapshots(sandbox_id=sbx.sandbox_id, limit=1), []
        while pages.has_next:
            seen += [s.snapshot_id for s in pages.next_items()]
            assert len(seen) <= 2
        assert set(seen) == {named.snapshot_id, unnamed.snapshot_id}
        # Another tenant sees none of them.
        other = Sandbox.list_snapshots(api_key=env.other_key).next_items()
        assert not {s.snapshot_id for s in other} & listed
        assert Sandbox.delete_snapshot(named.snapshot_id, api_key=env.other_key) is False
        with pytest.raises(SandboxNotFoundException):
            Sandbox.create_snapshot(sbx.sandbox_id, api_key=env.other_key)
    finally:
        assert Sandbox.delete_snapshot(named.snapshot_id) is True
        assert Sandbox.delete_snapshot(unnamed.snapshot_id) is True
    assert Sandbox.delete_snapshot(named.snapshot_id) is False
    assert not {s.snapshot_id for s in Sandbox.list_snapshots().next_items()} & {
        named.snapshot_id,
        unnamed.snapshot_id,
    }


@sdk("Sandbox.create(<snapshot id>): sandboxes from a snapshot, independent of each other")
@bound(240)
def test_sandboxes_from_a_snapshot_start_with_its_files(env, make_sandbox):
    _require_snapshots()
    sbx = make_sandbox()
    sbx.files.make_dir(f"{HOME}/app")
    sbx.files.write(f"{HOME}/app/config.json", '{"env": "test"}')
    sbx.files.write(f"{HOME}/shared.txt", "shared snapshot content")
    snapshot = sbx.create_snapshot()
    try:
        one = make_sandbox(template=snapshot.snapshot_id)
        two = make_sandbox(template=snapshot.snapshot_id)
        assert one.sandbox_id != two.sandbox_id
        for s in (one, two):
            assert s.files.exists(f"{HOME}/app")
            assert s.files.read(f"{HOME}/app/config.json") == '{"env": "test"}'
            assert s.files.read(f"{HOME}/shared.txt") == "shared snapshot content"
        one.files.write(f"{HOME}/shared.txt", "modified in one")
        assert one.files.read(f"{HOME}/shared.txt") == "modified in one"
        assert two.files.read(f"{HOME}/shared.txt") == "shared snapshot content"
        assert sbx.files.read(f"{HOME}/shared.txt") == "shared snapshot content"
        # The snapshot outlives the sandbox it was taken of.
        sbx.kill()
        make_sandbox.forget(sbx.sandbox_id)
        three = make_sandbox(template=snapshot.snapshot_id)
        assert three.files.read(f"{HOME}/shared.txt") == "shared snapshot content"
        # Another tenant's create does not find it.
        with pytest.raises(SandboxException) as caught:
            Sandbox.create(snapshot.snapshot_id, api_key=env.other_key, request_timeout=REQUEST_TIMEOUT_S)
        assert getattr(caught.value, "status_code", None) == 404
    finally:
        assert Sandbox.delete_snapshot(snapshot.snapshot_id) is True


@sdk("Sandbox.fork (one, several, by id; a killed sandbox; a bad count)")
@bound(240)
def test_fork_copies_the_sandbox_and_leaves_it_running(env, make_sandbox):
    _require_snapshots()
    with pytest.raises(InvalidArgumentException):
        Sandbox.fork("sbx-test", count=0)
    sbx = make_sandbox()
    sbx.files.write(f"{HOME}/state.txt", "state before fork")
    forks = sbx.fork()
    assert len(forks) == 1 and isinstance(forks[0], Sandbox), forks
    made = list(forks)
    try:
        fork = forks[0]
        assert fork.sandbox_id != sbx.sandbox_id
        assert sbx.is_running() and fork.is_running()
        assert fork.files.read(f"{HOME}/state.txt") == "state before fork"
        fork.files.write(f"{HOME}/state.txt", "modified in fork")
        assert sbx.files.read(f"{HOME}/state.txt") == "state before fork"
        more = sbx.fork(count=2, timeout=60)
        made += [f for f in more if isinstance(f, Sandbox)]
        assert len(more) == 2 and all(isinstance(f, Sandbox) for f in more), more
        ids = {f.sandbox_id for f in more}
        assert len(ids) == 2 and sbx.sandbox_id not in ids
        assert all(f.files.read(f"{HOME}/state.txt") == "state before fork" for f in more)
        by_id = Sandbox.fork(sbx.sandbox_id)
        made += [f for f in by_id if isinstance(f, Sandbox)]
        assert len(by_id) == 1 and by_id[0].is_running()
        # A fork belongs to the tenant of its parent.
        with pytest.raises(SandboxNotFoundException):
            Sandbox.fork(sbx.sandbox_id, api_key=env.other_key)
        # No snapshot is left behind by a fork.
        assert Sandbox.list_snapshots(sandbox_id=sbx.sandbox_id).next_items() == []
    finally:
        for f in made:
            f.kill()
    sbx.kill()
    make_sandbox.forget(sbx.sandbox_id)
    with pytest.raises(SandboxNotFoundException):
        sbx.fork()


@sdk("Sandbox.create(lifecycle=...): paused at its timeout, resumed by traffic or by connect")
@bound(120)
def test_lifecycle_pauses_at_timeout_and_resumes(env, make_sandbox):
    def state(s: Sandbox) -> SandboxState:
        return Sandbox.get_info(s.sandbox_id).state

    # Long enough to make both and write to them on a slow host (an emulated guest); then
    # a short timeout, which pauses them.
    auto = make_sandbox(timeout=120, lifecycle={"on_timeout": "pause", "auto_resume": True})
    manual = make_sandbox(timeout=120, lifecycle={"on_timeout": "pause"})
    for s in (auto, manual):
        s.files.write(f"{HOME}/life.txt", "alive")
    assert auto.get_info().lifecycle == {"on_timeout": "pause", "auto_resume": True}
    assert manual.get_info().lifecycle == {"on_timeout": "pause", "auto_resume": False}
    for s in (auto, manual):
        s.set_timeout(3)
    for s in (auto, manual):
        assert wait_until(lambda: state(s) == SandboxState.PAUSED, 30), state(s)
    # Paused, neither expires: it is still there, paused, after its timeout again.
    time.sleep(4)
    assert state(auto) == SandboxState.PAUSED and state(manual) == SandboxState.PAUSED
    # Traffic resumes the one that resumes on traffic, files and all.
    assert auto.files.read(f"{HOME}/life.txt") == "alive"
    assert state(auto) == SandboxState.RUNNING
    assert auto.commands.run("echo up").stdout == "up\n"
    # The other stays paused until connected.
    with pytest.raises(SandboxException):
        manual.files.read(f"{HOME}/life.txt", request_timeout=REQUEST_TIMEOUT_S)
    assert state(manual) == SandboxState.PAUSED
    resumed = manual.connect(timeout=60)
    assert state(manual) == SandboxState.RUNNING
    assert resumed.files.read(f"{HOME}/life.txt") == "alive"


def _boot_id(sbx: Sandbox) -> str:
    boot = sbx.commands.run("cat /proc/sys/kernel/random/boot_id").stdout.strip()
    assert re.fullmatch(r"[0-9a-f-]{36}", boot), boot
    return boot


@sdk("Sandbox.pause(mode='filesystem') / connect / connect(on_resume='reboot'): a boot that keeps the files")
@bound(180)
def test_a_pause_without_memory_reboots_at_connect_and_keeps_the_files(env, make_sandbox):
    if not os.environ.get("TETHER_SUITE_PAUSE_FILESYSTEM"):
        pytest.skip("the provider of this run cannot pause without memory")
    sbx = make_sandbox()
    sbx.files.write(f"{HOME}/fs-only.txt", "kept across the boot")
    sbx.commands.run("sleep 600", background=True)
    before = _boot_id(sbx)
    assert sbx.pause(mode="filesystem") is True
    assert sbx.is_running() is False
    assert Sandbox.get_info(sbx.sandbox_id).state == SandboxState.PAUSED
    # Paused already: the SDK's False, not an error.
    assert sbx.pause(mode="filesystem") is False
    resumed = sbx.connect(timeout=60)
    assert resumed.sandbox_id == sbx.sandbox_id and resumed.is_running()
    assert resumed.files.read(f"{HOME}/fs-only.txt") == "kept across the boot"
    assert resumed.commands.run("pgrep -x sleep || echo none").stdout == "none\n"
    after = _boot_id(resumed)
    assert after != before
    # A pause that kept memory keeps processes at a plain connect, and a reboot drops
    # them at connect(on_resume="reboot").
    resumed.commands.run("sleep 600", background=True)
    assert resumed.pause() is True
    again = resumed.connect(timeout=60)
    assert _boot_id(again) == after
    assert again.commands.run("pgrep -x sleep >/dev/null && echo up").stdout == "up\n"
    assert again.pause() is True
    rebooted = again.connect(timeout=60, on_resume="reboot")
    assert _boot_id(rebooted) not in (before, after)
    assert rebooted.commands.run("pgrep -x sleep || echo none").stdout == "none\n"
    assert rebooted.files.read(f"{HOME}/fs-only.txt") == "kept across the boot"
    # A boot starts with an empty /run: the sandbox's markers are written again.
    assert rebooted.commands.run("cat /run/e2b/.E2B_SANDBOX_ID").stdout == rebooted.sandbox_id


@sdk("Sandbox.create(lifecycle={'on_timeout': {'action': 'pause', 'mode': 'filesystem'}})")
@bound(120)
def test_a_timeout_pause_without_memory_is_resumed_only_by_connect(env, make_sandbox):
    if not os.environ.get("TETHER_SUITE_PAUSE_FILESYSTEM"):
        pytest.skip("the provider of this run cannot pause without memory")
    # As E2B answers: a pause without memory cannot resume on traffic.
    with pytest.raises(InvalidArgumentException):
        Sandbox.create(
            timeout=3,
            lifecycle={
                "on_timeout": {"action": "pause", "mode": "filesystem"},
                "auto_resume": True,
            },
        )
    sbx = make_sandbox(
        timeout=3, lifecycle={"on_timeout": {"action": "pause", "mode": "filesystem"}}
    )
    sbx.files.write(f"{HOME}/marker.txt", "auto-pause-fs-only")
    before = _boot_id(sbx)
    assert wait_until(
        lambda: Sandbox.get_info(sbx.sandbox_id).state == SandboxState.PAUSED, 30
    )
    with pytest.raises(SandboxException):
        sbx.files.read(f"{HOME}/marker.txt", request_timeout=REQUEST_TIMEOUT_S)
    resumed = sbx.connect(timeout=60)
    assert resumed.files.read(f"{HOME}/marker.txt") == "auto-pause-fs-only"
    assert _boot_id(resumed) != before
