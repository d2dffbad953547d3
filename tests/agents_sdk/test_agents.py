"""Whole agent turns of the OpenAI Agents SDK's E2B sandbox against tetherd.

Every test runs `Runner.run` on a `SandboxAgent` whose model is `ScriptedModel`: the script makes
the agent use the sandbox's own tools (`exec_command`, `apply_patch`) for real, and each step's
check judges the tool output the Runner handed back *and* what the sandbox holds, read through
the plain `e2b` SDK. The sandbox client is `E2BSandboxClient` with the SDK's default options
(`sandbox_type` has no default; `e2b` is chosen): on-timeout pause with auto-resume, workspace
root `/workspace`, the manifest materialized at start, the default local snapshot store (tar
persistence) or native E2B snapshots, the sandbox killed when the run ends.

Scenarios, in order (the resume tests use what the turn before them left):

* tar turn 1: a fresh sandbox, manifest materialized, shell + apply_patch; after the run the
  sandbox is gone and the workspace is in the local tar snapshot;
* tar turn 2: the conversation goes on from the serialized run state: a new sandbox with the
  workspace restored from that tar;
* snapshot turn 1 / turn 2: the same with `workspace_persistence="snapshot"` (E2B snapshots);
* pause mid-turn: the sandbox's lifetime runs out while the "model thinks"; the default
  on-timeout pause keeps it, and the next tool call resumes it (auto-resume);
* resume a paused sandbox: a live session outlives its run (as when the process holding it goes
  away), times out into a pause, and a later run resumes the same sandbox from its saved state.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import json
import tarfile
import time
import zlib
from pathlib import Path
from typing import Any, Dict, List

import pytest

from conftest import REQUEST_TIMEOUT_S, saw_sandbox, saw_snapshot, state_home

from agents import Runner, RunConfig
from agents.extensions.sandbox.e2b import (
    E2BSandboxClient,
    E2BSandboxClientOptions,
    E2BSandboxType,
)
from agents.sandbox import Manifest, SandboxAgent, SandboxRunConfig
from agents.sandbox.entries import Dir, File
from e2b import AsyncSandbox
from e2b.exceptions import NotFoundException

from scripted_model import (
    Probe,
    ScriptedModel,
    Step,
    apply_patch,
    exec_command,
    final_message,
    parse_exec_output,
    view_image,
    write_stdin,
)

#: Longest one `Runner.run` may take.
RUN_BOUND_S = 150.0
#: Longest a sandbox may take to pause once its lifetime ran out.
PAUSE_BOUND_S = 30.0

README = b"# tether agents suite\nmanifest line two\n"
CONFIG = b'{"answer": 42}\n'
WORKSPACE = "/workspace"
SNAPSHOT_MAGIC = b"E2B_SANDBOX_SNAPSHOT_V1\n"


def manifest() -> Manifest:
    return Manifest(
        entries={
            "notes": Dir(children={"readme.md": File(content=README)}),
            "data": Dir(children={"config.json": File(content=CONFIG)}),
        }
    )


def default_options(**overrides: Any) -> E2BSandboxClientOptions:
    return E2BSandboxClientOptions(sandbox_type=E2BSandboxType.E2B, **overrides)


def agent(model: ScriptedModel) -> SandboxAgent:
    return SandboxAgent(
        name="tether-agents-suite",
        instructions="Work in the sandbox workspace with the tools you have.",
        model=model,
        default_manifest=manifest(),
    )


async def run(agent_: SandboxAgent, input_: Any, sandbox: SandboxRunConfig, steps: int) -> Any:
    config = RunConfig(tracing_disabled=True, sandbox=sandbox)
    return await asyncio.wait_for(
        Runner.run(agent_, input_, run_config=config, max_turns=steps + 2), RUN_BOUND_S
    )


def drive(coro) -> Any:
    return asyncio.run(coro)


# === checks shared by the scenarios ===


def exec_ok(raw: str) -> str:
    out = parse_exec_output(raw)
    assert out.exit_code == 0, f"exec_command did not exit 0: {raw!r}"
    return out.output


def expect_exec(expected: str):
    async def check(raw: str, probe: Probe) -> None:
        got = exec_ok(raw)
        assert got == expected, f"command output {got!r}, expected {expected!r}"

    return check


async def assert_gone(sandbox_id: str, why: str) -> None:
    try:
        info = await AsyncSandbox.get_info(sandbox_id, request_timeout=REQUEST_TIMEOUT_S)
    except NotFoundException:
        return
    raise AssertionError(f"sandbox {sandbox_id} still exists ({info.state}) {why}")


async def wait_state(sandbox_id: str, want: str, bound_s: float) -> float:
    """Poll the control plane until the sandbox is in `want`; returns the seconds it took."""
    t0 = time.monotonic()
    last = None
    while time.monotonic() - t0 < bound_s:
        info = await AsyncSandbox.get_info(sandbox_id, request_timeout=REQUEST_TIMEOUT_S)
        last = getattr(info.state, "value", info.state)
        if last == want:
            return time.monotonic() - t0
        await asyncio.sleep(0.2)
    raise AssertionError(f"sandbox {sandbox_id} is {last!r} after {bound_s:.0f} s, not {want!r}")


def lifecycle_of(info: Any) -> Dict[str, Any]:
    raw = info.lifecycle or {}
    return {k: getattr(v, "value", v) for k, v in dict(raw).items()}


def run_state_json(result: Any, turn: str) -> Dict[str, Any]:
    """The run state as an application would store it (real JSON), read back."""
    payload = json.loads(json.dumps(result.to_state().to_json()))
    sandbox = payload.get("sandbox")
    assert isinstance(sandbox, dict) and isinstance(sandbox.get("session_state"), dict), (
        f"{turn}: the run state holds no sandbox session (the SDK's end-of-run cleanup failed; "
        "see the captured 'Failed to clean up sandbox resources' warning)"
    )
    return payload


def persisted_bytes(session_state: Dict[str, Any]) -> bytes:
    snap = session_state["snapshot"]
    assert snap["type"] == "local", f"default snapshot store is not local: {snap}"
    base = Path(snap["base_path"])
    assert str(base).startswith(state_home()), f"snapshot store {base} outside the run's state home"
    path = base / f"{snap['id']}.tar"
    assert path.is_file(), f"no persisted workspace at {path}"
    return path.read_bytes()


def tar_members(raw: bytes) -> Dict[str, bytes]:
    out: Dict[str, bytes] = {}
    with tarfile.open(fileobj=io.BytesIO(raw)) as tf:
        for m in tf.getmembers():
            if m.isfile():
                f = tf.extractfile(m)
                assert f is not None
                out[m.name.removeprefix("./")] = f.read()
    return out


async def listed_snapshot_ids() -> List[str]:
    paginator = AsyncSandbox.list_snapshots(request_timeout=REQUEST_TIMEOUT_S)
    ids: List[str] = []
    while paginator.has_next:
        ids.extend(s.snapshot_id for s in await paginator.next_items())
    return ids


# === the two-turn conversations (tar and snapshot persistence) ===

GREET_V1 = b'#!/bin/sh\necho "hello from turn one"\necho "mode: MODE"'
GREET_V2 = b'#!/bin/sh\necho "hello from a patched turn one"\necho "mode: MODE"'
GREET_V3 = GREET_V2 + b'\necho "and again in turn two"'
TURN2_DOC = b"# turn two\nresumed into a new sandbox"

#: What each turn one hands to its turn two, by persistence mode.
_carried: Dict[str, Dict[str, Any]] = {}


def _m(data: bytes, mode: str) -> bytes:
    return data.replace(b"MODE", mode.encode())


def turn_one_script(mode: str) -> List[Step]:
    p = f"{mode}1"
    greet_v1, greet_v2 = _m(GREET_V1, mode), _m(GREET_V2, mode)
    greet_out = f"hello from a patched turn one\nmode: {mode}\n".encode()

    async def check_manifest(raw: str, probe: Probe) -> None:
        got = exec_ok(raw)
        expected = (
            f"{WORKSPACE}\n"
            + (README + CONFIG).decode()
            + "755 notes\n755 notes/readme.md\n"  # the manifest entries' default permissions
            + "data\nnotes\nuname.txt\n"
        )
        assert got == expected, f"exec output {got!r}, expected {expected!r}"
        assert await probe.read(f"{WORKSPACE}/notes/readme.md") == README
        assert await probe.read(f"{WORKSPACE}/data/config.json") == CONFIG
        assert await probe.read(f"{WORKSPACE}/uname.txt") == b"Linux\n"

    async def check_created(raw: str, probe: Probe) -> None:
        assert raw == "Created src/greet.sh", f"apply_patch answered {raw!r}"
        assert await probe.read(f"{WORKSPACE}/src/greet.sh") == greet_v1

    async def check_updated(raw: str, probe: Probe) -> None:
        assert raw == "Updated src/greet.sh", f"apply_patch answered {raw!r}"
        assert await probe.read(f"{WORKSPACE}/src/greet.sh") == greet_v2

    async def check_ran(raw: str, probe: Probe) -> None:
        got = exec_ok(raw)
        assert got == (greet_out + greet_v2).decode(), f"exec output {got!r}"
        assert await probe.read(f"{WORKSPACE}/greet.out") == greet_out
        r = await probe.run(f"sha256sum {WORKSPACE}/src/greet.sh")
        assert r.stdout.split()[0] == hashlib.sha256(greet_v2).hexdigest(), r.stdout

    return [
        Step(
            "exec_command: pwd, the materialized manifest (contents, modes), write uname.txt",
            exec_command(
                f"{p}-a",
                "pwd && cat notes/readme.md data/config.json && "
                "stat -c '%a %n' notes notes/readme.md && uname -s > uname.txt && ls -A",
            ),
            check_manifest,
        ),
        Step(
            "apply_patch: Add File src/greet.sh",
            apply_patch(
                f"{p}-b",
                "*** Begin Patch\n*** Add File: src/greet.sh\n"
                + "".join(f"+{line}\n" for line in greet_v1.decode().split("\n"))
                + "*** End Patch\n",
            ),
            check_created,
        ),
        Step(
            "apply_patch: Update File src/greet.sh",
            apply_patch(
                f"{p}-c",
                "*** Begin Patch\n*** Update File: src/greet.sh\n@@\n #!/bin/sh\n"
                '-echo "hello from turn one"\n+echo "hello from a patched turn one"\n'
                f' echo "mode: {mode}"\n*** End Patch\n',
            ),
            check_updated,
        ),
        Step(
            "exec_command: run the patched script, read it back",
            exec_command(f"{p}-d", "sh src/greet.sh > greet.out && cat greet.out src/greet.sh"),
            check_ran,
        ),
        Step("final answer", final_message(f"turn one ({mode}) done")),
    ]


def turn_two_script(mode: str, first_sandbox: str) -> List[Step]:
    p = f"{mode}2"
    greet_v2, greet_v3 = _m(GREET_V2, mode), _m(GREET_V3, mode)
    greet_out = f"hello from a patched turn one\nmode: {mode}\n"

    async def check_restored(raw: str, probe: Probe) -> None:
        got = exec_ok(raw)
        expected = greet_v2.decode() + "\n---\n" + greet_out + "Linux\n" + (README + CONFIG).decode()
        assert got == expected, f"restored workspace reads {got!r}, expected {expected!r}"
        assert probe.sandbox_id != first_sandbox, "turn two did not get a new sandbox"
        info = await probe.info()
        assert getattr(info.state, "value", info.state) == "running"
        assert await probe.read(f"{WORKSPACE}/src/greet.sh") == greet_v2

    async def check_patched(raw: str, probe: Probe) -> None:
        assert raw == "Updated src/greet.sh\nCreated docs/turn2.md", f"apply_patch answered {raw!r}"
        assert await probe.read(f"{WORKSPACE}/src/greet.sh") == greet_v3
        assert await probe.read(f"{WORKSPACE}/docs/turn2.md") == TURN2_DOC

    return [
        Step(
            "exec_command: the workspace came back in a new sandbox",
            exec_command(
                f"{p}-a",
                "cat src/greet.sh && echo && echo --- && "
                "cat greet.out uname.txt notes/readme.md data/config.json",
            ),
            check_restored,
        ),
        Step(
            "apply_patch: Update src/greet.sh + Add File docs/turn2.md (one patch)",
            apply_patch(
                f"{p}-b",
                "*** Begin Patch\n*** Update File: src/greet.sh\n@@\n"
                ' echo "hello from a patched turn one"\n'
                f' echo "mode: {mode}"\n'
                '+echo "and again in turn two"\n'
                "*** Add File: docs/turn2.md\n+# turn two\n+resumed into a new sandbox\n"
                "*** End Patch\n",
            ),
            check_patched,
        ),
        Step(
            "exec_command: run it again",
            exec_command(f"{p}-c", "sh src/greet.sh && ls docs"),
            expect_exec(greet_out + "and again in turn two\nturn2.md\n"),
        ),
        Step("final answer", final_message(f"turn two ({mode}) done")),
    ]


def _turn_one(mode: str, turns) -> None:
    async def body() -> None:
        script = turn_one_script(mode)
        model = ScriptedModel(f"{mode} turn 1", script, saw_sandbox)
        client = E2BSandboxClient()
        options = default_options() if mode == "tar" else default_options(
            workspace_persistence="snapshot"
        )
        try:
            result = await run(
                agent(model),
                "Set up the greeting script.",
                SandboxRunConfig(client=client, options=options),
                len(script),
            )
        finally:
            turns.add("turn 1", model.trace)
        assert model.finished, f"script not played to its end: {model.trace}"
        assert result.final_output == f"turn one ({mode}) done"
        sid = model.sandbox_ids[-1]

        payload = run_state_json(result, "turn 1")
        ss = payload["sandbox"]["session_state"]
        assert ss["sandbox_id"] == sid
        assert ss["workspace_persistence"] == mode
        assert (ss["on_timeout"], ss["auto_resume"], ss["pause_on_exit"]) == ("pause", True, False)
        assert ss["manifest"]["root"] == WORKSPACE

        # The SDK's default end of run: the workspace persisted, then the sandbox killed.
        await assert_gone(sid, "after the run (the SDK kills it at the end of a run)")
        raw = persisted_bytes(ss)
        if mode == "tar":
            files = tar_members(raw)
            want = {
                "src/greet.sh": _m(GREET_V2, mode),
                "greet.out": f"hello from a patched turn one\nmode: {mode}\n".encode(),
                "uname.txt": b"Linux\n",
                "notes/readme.md": README,
                "data/config.json": CONFIG,
            }
            for name, data in want.items():
                assert files.get(name) == data, f"tar snapshot {name}: {files.get(name)!r}"
            turns.note(f"tar snapshot of {len(raw)} bytes holds {sorted(files)}")
        else:
            assert raw.startswith(SNAPSHOT_MAGIC), f"not a native snapshot reference: {raw[:60]!r}"
            snap_id = json.loads(raw[len(SNAPSHOT_MAGIC) :])["snapshot_id"]
            saw_snapshot(snap_id)
            assert snap_id in await listed_snapshot_ids(), f"snapshot {snap_id} not listed"
            turns.note(f"native snapshot {snap_id}")
        _carried[mode] = {
            "input": result.to_input_list(),
            "state": json.dumps(payload),
            "sandbox": sid,
            "persisted": raw,
        }

    drive(body())


def _turn_two(mode: str, turns) -> None:
    carried = _carried.get(mode)
    if carried is None:
        pytest.skip(f"needs the {mode} turn 1, which did not finish")

    async def body() -> None:
        script = turn_two_script(mode, carried["sandbox"])
        model = ScriptedModel(f"{mode} turn 2", script, saw_sandbox)
        client = E2BSandboxClient()
        saved = json.loads(carried["state"])["sandbox"]["session_state"]
        state = client.deserialize_session_state(saved)
        input_ = list(carried["input"]) + [
            {"role": "user", "content": "Carry on: extend the script and document it."}
        ]
        try:
            result = await run(
                agent(model),
                input_,
                SandboxRunConfig(client=client, session_state=state),
                len(script),
            )
        finally:
            turns.add("turn 2", model.trace)
        assert model.finished, f"script not played to its end: {model.trace}"
        assert result.final_output == f"turn two ({mode}) done"
        sid = model.sandbox_ids[-1]
        assert sid != carried["sandbox"]
        turns.note(f"turn 1 sandbox {carried['sandbox']}, turn 2 sandbox {sid}")

        payload = run_state_json(result, "turn 2")
        ss = payload["sandbox"]["session_state"]
        await assert_gone(sid, "after turn 2")
        raw = persisted_bytes(ss)
        if mode == "tar":
            files = tar_members(raw)
            assert files.get("src/greet.sh") == _m(GREET_V3, mode)
            assert files.get("docs/turn2.md") == TURN2_DOC
        else:
            assert raw.startswith(SNAPSHOT_MAGIC)
            snap_id = json.loads(raw[len(SNAPSHOT_MAGIC) :])["snapshot_id"]
            saw_snapshot(snap_id)
            assert snap_id != json.loads(carried["persisted"][len(SNAPSHOT_MAGIC) :])[
                "snapshot_id"
            ], "turn 2 persisted under turn 1's snapshot id"

    drive(body())


@pytest.mark.turn("tar: turn 1, fresh sandbox, manifest, shell + apply_patch")
@pytest.mark.timeout(240)
def test_tar_turn_one(server, turns):
    _turn_one("tar", turns)


@pytest.mark.turn("tar: turn 2, resumed into a new sandbox from the tar")
@pytest.mark.timeout(240)
def test_tar_turn_two_resume(server, turns):
    _turn_two("tar", turns)


@pytest.mark.turn("snapshot: turn 1, workspace persisted as an E2B snapshot")
@pytest.mark.timeout(240)
def test_snapshot_turn_one(server, turns):
    _turn_one("snapshot", turns)


@pytest.mark.turn("snapshot: turn 2, resumed into a sandbox made from it")
@pytest.mark.timeout(240)
def test_snapshot_turn_two_resume(server, turns):
    _turn_two("snapshot", turns)


# === the default on-timeout pause ===

MARKER_V1 = b"before-pause\nafter-resume\n"
MARKER_V2 = b"before-pause\nafter-resume\npatched after resume\n"


@pytest.mark.turn("on-timeout pause mid-turn, next tool call auto-resumes")
@pytest.mark.timeout(240)
def test_timeout_pause_mid_turn(server, turns):
    async def check_written(raw: str, probe: Probe) -> None:
        assert exec_ok(raw) == "before-pause\n"
        info = await probe.info()
        assert lifecycle_of(info) == {"on_timeout": "pause", "auto_resume": True}, (
            f"the sandbox's lifecycle is {info.lifecycle}, the SDK asked for pause + auto-resume"
        )

    paused: Dict[str, float] = {}

    async def let_it_time_out(probe: Probe):
        # The model "thinks" past the sandbox's lifetime: the harness cuts the lifetime short
        # through the control plane and waits for the default on-timeout action.
        sid = probe.sandbox_id
        await AsyncSandbox.set_timeout(sid, 1, request_timeout=REQUEST_TIMEOUT_S)
        paused["after_s"] = await wait_state(sid, "paused", PAUSE_BOUND_S)
        return exec_command(
            "pause-b",
            "cat state/marker.txt && echo after-resume >> state/marker.txt && cat notes/readme.md",
        )

    async def check_resumed(raw: str, probe: Probe) -> None:
        assert exec_ok(raw) == "before-pause\n" + README.decode()
        info = await probe.info()
        assert getattr(info.state, "value", info.state) == "running"
        assert await probe.read(f"{WORKSPACE}/state/marker.txt") == MARKER_V1

    async def check_patched(raw: str, probe: Probe) -> None:
        assert raw == "Updated state/marker.txt", f"apply_patch answered {raw!r}"
        assert await probe.read(f"{WORKSPACE}/state/marker.txt") == MARKER_V2

    script = [
        Step(
            "exec_command: write state/marker.txt",
            exec_command(
                "pause-a",
                "mkdir -p state && echo before-pause > state/marker.txt && cat state/marker.txt",
            ),
            check_written,
        ),
        Step(
            "[lifetime runs out, sandbox pauses] exec_command on the paused sandbox",
            let_it_time_out,
            check_resumed,
        ),
        Step(
            "apply_patch: Update File state/marker.txt after the resume",
            apply_patch(
                "pause-c",
                "*** Begin Patch\n*** Update File: state/marker.txt\n@@\n before-pause\n"
                " after-resume\n+patched after resume\n*** End Patch\n",
            ),
            check_patched,
        ),
        Step(
            "exec_command: read it back",
            exec_command("pause-d", "cat state/marker.txt"),
            expect_exec(MARKER_V2.decode()),
        ),
        Step("final answer", final_message("paused and resumed")),
    ]

    async def body() -> None:
        model = ScriptedModel("pause mid-turn", script, saw_sandbox)
        try:
            result = await run(
                agent(model),
                "Keep state across a long think.",
                SandboxRunConfig(client=E2BSandboxClient(), options=default_options()),
                len(script),
            )
        finally:
            turns.add("turn", model.trace)
        assert model.finished, f"script not played to its end: {model.trace}"
        assert result.final_output == "paused and resumed"
        assert len(set(model.sandbox_ids)) == 1, f"the sandbox changed: {model.sandbox_ids}"
        turns.note(f"paused {paused.get('after_s', -1):.1f} s after its lifetime was cut to 1 s")
        await assert_gone(model.sandbox_ids[-1], "after the run")

    drive(body())


@pytest.mark.turn("paused by timeout after its run, resumed by the next run (connect)")
@pytest.mark.timeout(240)
def test_resume_paused_sandbox(server, turns):
    progress_v1 = b"# progress\n- step a done"
    progress_v2 = progress_v1 + b"\n- step b done"

    async def check_a_created(raw: str, probe: Probe) -> None:
        assert raw == "Created work/progress.md", f"apply_patch answered {raw!r}"
        assert await probe.read(f"{WORKSPACE}/work/progress.md") == progress_v1

    script_a = [
        Step(
            "apply_patch: Add File work/progress.md",
            apply_patch(
                "live-a1",
                "*** Begin Patch\n*** Add File: work/progress.md\n+# progress\n+- step a done\n"
                "*** End Patch\n",
            ),
            check_a_created,
        ),
        Step(
            "exec_command: append work/log.txt",
            exec_command("live-a2", "echo step-a >> work/log.txt && cat work/log.txt"),
            expect_exec("step-a\n"),
        ),
        Step("final answer", final_message("run A done")),
    ]

    async def body() -> None:
        client = E2BSandboxClient()
        session = await asyncio.wait_for(
            client.create(options=default_options(), manifest=manifest()), RUN_BOUND_S
        )
        sid = session.state.sandbox_id
        saw_sandbox(sid)
        model_a = ScriptedModel("run A", script_a, saw_sandbox)
        try:
            await run(agent(model_a), "Start the work.", SandboxRunConfig(session=session), 3)
        finally:
            turns.add("run A", model_a.trace)
        assert model_a.finished, f"script not played to its end: {model_a.trace}"
        # A live session is the caller's: the run leaves it running.
        info = await AsyncSandbox.get_info(sid, request_timeout=REQUEST_TIMEOUT_S)
        assert getattr(info.state, "value", info.state) == "running"
        saved = json.dumps(client.serialize_session_state(session.state))
        # The process holding the session goes away; the sandbox's lifetime runs out.
        del session
        await AsyncSandbox.set_timeout(sid, 1, request_timeout=REQUEST_TIMEOUT_S)
        took = await wait_state(sid, "paused", PAUSE_BOUND_S)
        turns.note(f"sandbox {sid} paused {took:.1f} s after its lifetime was cut to 1 s")

        async def check_b_preserved(raw: str, probe: Probe) -> None:
            got = exec_ok(raw)
            assert got == progress_v1.decode() + "\nstep-a\n", f"exec output {got!r}"
            assert probe.sandbox_id == sid, f"resumed into {probe.sandbox_id}, not {sid}"
            info = await probe.info()
            assert getattr(info.state, "value", info.state) == "running"

        async def check_b_patched(raw: str, probe: Probe) -> None:
            assert raw == "Updated work/progress.md", f"apply_patch answered {raw!r}"
            assert await probe.read(f"{WORKSPACE}/work/progress.md") == progress_v2

        script_b = [
            Step(
                "exec_command: the paused sandbox's files are there",
                exec_command(
                    "live-b1",
                    "cat work/progress.md && echo && cat work/log.txt && echo step-b >> work/log.txt",
                ),
                check_b_preserved,
            ),
            Step(
                "apply_patch: Update File work/progress.md",
                apply_patch(
                    "live-b2",
                    "*** Begin Patch\n*** Update File: work/progress.md\n@@\n # progress\n"
                    " - step a done\n+- step b done\n*** End Patch\n",
                ),
                check_b_patched,
            ),
            Step(
                "exec_command: read both back",
                exec_command("live-b3", "cat work/progress.md && echo && cat work/log.txt"),
                expect_exec(progress_v2.decode() + "\nstep-a\nstep-b\n"),
            ),
            Step("final answer", final_message("run B done")),
        ]
        model_b = ScriptedModel("run B", script_b, saw_sandbox)
        state = client.deserialize_session_state(json.loads(saved))
        try:
            result = await run(
                agent(model_b),
                "Resume the work.",
                SandboxRunConfig(client=client, session_state=state),
                len(script_b),
            )
        finally:
            turns.add("run B", model_b.trace)
        assert model_b.finished, f"script not played to its end: {model_b.trace}"
        assert result.final_output == "run B done"
        assert model_b.sandbox_ids == [sid]
        await assert_gone(sid, "after run B (the resumed run owns and kills it)")

    drive(body())


# === the rest of the default shell and filesystem tools ===


def tiny_png() -> bytes:
    """A valid 2x1 RGB PNG, made here (no fixture file)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return len(data).to_bytes(4, "big") + body + zlib.crc32(body).to_bytes(4, "big")

    header = (2).to_bytes(4, "big") + (1).to_bytes(4, "big") + bytes([8, 2, 0, 0, 0])
    pixels = zlib.compress(b"\x00" + bytes([255, 0, 0, 0, 0, 255]))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(
        b"IEND", b""
    )


@pytest.mark.turn("shell sessions (poll, tty + stdin), exit codes, workdir, view_image")
@pytest.mark.timeout(240)
def test_shell_sessions_and_images(server, turns):
    png = tiny_png()
    sessions: Dict[str, int] = {}

    async def check_started(raw: str, probe: Probe) -> None:
        out = parse_exec_output(raw)
        assert out.exit_code is None and out.session_id is not None, (
            f"a command still sleeping should be reported running: {raw!r}"
        )
        assert out.output == "start\n", f"output so far {out.output!r}"
        sessions["bg"] = out.session_id

    async def check_polled(raw: str, probe: Probe) -> None:
        out = parse_exec_output(raw)
        assert (out.exit_code, out.output) == (0, "end\n"), f"poll answered {raw!r}"
        assert await probe.read(f"{WORKSPACE}/bg.log") == b"start\nend\n"

    async def check_failed(raw: str, probe: Probe) -> None:
        out = parse_exec_output(raw)
        assert out.exit_code == 3, f"exit code not passed through: {raw!r}"
        assert "no-such-file" in out.output and "No such file" in out.output, out.output

    async def check_tty_started(raw: str, probe: Probe) -> None:
        out = parse_exec_output(raw)
        assert out.exit_code is None and out.session_id is not None, (
            f"`read` on a tty should wait for input: {raw!r}"
        )
        sessions["tty"] = out.session_id

    async def check_typed(raw: str, probe: Probe) -> None:
        out = parse_exec_output(raw)
        assert "got:hello-tty" in out.output, f"the tty did not echo the line read: {raw!r}"
        assert await probe.read(f"{WORKSPACE}/tty.txt") == b"hello-tty\n"

    async def check_png(raw: str, probe: Probe) -> None:
        assert exec_ok(raw) == f"{len(png)}\n"
        assert await probe.read(f"{WORKSPACE}/img/dot.png") == png

    async def check_image(raw: str, probe: Probe) -> None:
        want = "data:image/png;base64," + base64.b64encode(png).decode()
        assert raw == want, f"view_image answered {raw[:120]!r}"

    async def check_missing(raw: str, probe: Probe) -> None:
        assert raw == "image path `img/missing.png` was not found", (
            f"a missing file must read as not found (envd 404): {raw!r}"
        )

    script = [
        Step(
            "exec_command: background command, first output before it ends",
            exec_command("sh-a", "echo start | tee bg.log; sleep 2; echo end | tee -a bg.log",
                         yield_time_ms=500),
            check_started,
        ),
        Step(
            "write_stdin: poll the running command to its end",
            lambda probe: write_stdin("sh-b", sessions["bg"], "", 8000),
            check_polled,
        ),
        Step(
            "exec_command: a failing command's exit code and stderr",
            exec_command("sh-c", "ls no-such-file; exit 3"),
            check_failed,
        ),
        Step(
            "exec_command: tty=true, waits on stdin",
            exec_command("sh-d", "read x; echo $x > tty.txt; echo got:$x", tty=True,
                         yield_time_ms=1000),
            check_tty_started,
        ),
        Step(
            "write_stdin: type a line into the tty",
            lambda probe: write_stdin("sh-e", sessions["tty"], "hello-tty\n", 3000),
            check_typed,
        ),
        Step(
            "exec_command: write a binary PNG",
            exec_command(
                "sh-f",
                f"mkdir -p img && printf %s {base64.b64encode(png).decode()} | base64 -d "
                "> img/dot.png && wc -c < img/dot.png",
            ),
            check_png,
        ),
        Step("view_image: img/dot.png", view_image("sh-g", "img/dot.png"), check_image),
        Step("view_image: a missing file", view_image("sh-h", "img/missing.png"), check_missing),
        Step(
            "exec_command: workdir=img",
            exec_command("sh-i", "pwd && ls", workdir="img"),
            expect_exec(f"{WORKSPACE}/img\ndot.png\n"),
        ),
        Step("final answer", final_message("shell and images done")),
    ]

    async def body() -> None:
        model = ScriptedModel("shell", script, saw_sandbox)
        try:
            result = await run(
                agent(model),
                "Exercise the shell.",
                SandboxRunConfig(client=E2BSandboxClient(), options=default_options()),
                len(script),
            )
        finally:
            turns.add("turn", model.trace)
        assert model.finished, f"script not played to its end: {model.trace}"
        assert result.final_output == "shell and images done"
        await assert_gone(model.sandbox_ids[-1], "after the run")

    drive(body())
