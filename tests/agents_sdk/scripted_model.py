"""A scripted stand-in for the LLM behind an Agents SDK agent.

`ScriptedModel` implements the `agents.models.interface.Model` interface: every time the Runner
asks it for a response it answers with the next step of a fixed script, a tool call (the
sandbox's `exec_command` function tool, or its `apply_patch` custom tool) or the final message.
Nothing is generated and nothing leaves the machine: no API key, no network.

A step can carry a `check`. It runs on the next model call, when the Runner hands the step's tool
output back in the input items, and gets the output text and a `Probe` that looks at the sandbox
through the plain `e2b` SDK (files, commands, the control plane's view). A failing check raises out
of `get_response`, which ends the run with that error. Every step leaves a line in `trace`.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, List, Optional, Union

from agents.items import ModelResponse, TResponseOutputItem
from agents.models.interface import Model
from agents.usage import Usage
from openai.types.responses import (
    ResponseCustomToolCall,
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)

#: Client-side limit of each probe request to tetherd, seconds.
PROBE_REQUEST_TIMEOUT_S = 20.0


# === tool-call items ===


def exec_command(call_id: str, cmd: str, **extra: Any) -> ResponseFunctionToolCall:
    """A call of the sandbox's `exec_command` function tool."""
    args = {"cmd": cmd, **extra}
    return ResponseFunctionToolCall(
        type="function_call",
        id=f"fc_{call_id}",
        call_id=call_id,
        name="exec_command",
        arguments=json.dumps(args),
        status="completed",
    )


def write_stdin(call_id: str, session_id: int, chars: str, yield_time_ms: int) -> ResponseFunctionToolCall:
    """A call of the sandbox's `write_stdin` function tool (poll or type into a running command)."""
    args = {"session_id": session_id, "chars": chars, "yield_time_ms": yield_time_ms}
    return ResponseFunctionToolCall(
        type="function_call",
        id=f"fc_{call_id}",
        call_id=call_id,
        name="write_stdin",
        arguments=json.dumps(args),
        status="completed",
    )


def view_image(call_id: str, path: str) -> ResponseFunctionToolCall:
    """A call of the sandbox's `view_image` function tool."""
    return ResponseFunctionToolCall(
        type="function_call",
        id=f"fc_{call_id}",
        call_id=call_id,
        name="view_image",
        arguments=json.dumps({"path": path}),
        status="completed",
    )


def apply_patch(call_id: str, patch: str) -> ResponseCustomToolCall:
    """A call of the sandbox's `apply_patch` custom (freeform) tool with a V4A patch."""
    return ResponseCustomToolCall(
        type="custom_tool_call",
        id=f"ctc_{call_id}",
        call_id=call_id,
        name="apply_patch",
        input=patch,
    )


def final_message(text: str) -> ResponseOutputMessage:
    return ResponseOutputMessage(
        type="message",
        id=f"msg_{uuid.uuid4().hex[:12]}",
        role="assistant",
        status="completed",
        content=[ResponseOutputText(type="output_text", text=text, annotations=[])],
    )


# === reading tool outputs ===

_EXIT_RE = re.compile(r"^Process exited with code (-?\d+)$", re.MULTILINE)
_SESSION_RE = re.compile(r"^Process running with session ID (\d+)$", re.MULTILINE)


@dataclass
class ExecOutput:
    """`exec_command`'s answer, split into its exit code and the command's output."""

    exit_code: Optional[int]
    #: Set while the command is still running (`write_stdin` reaches it by this id).
    session_id: Optional[int]
    output: str
    raw: str


def parse_exec_output(raw: str) -> ExecOutput:
    m = _EXIT_RE.search(raw)
    code = int(m.group(1)) if m else None
    s = _SESSION_RE.search(raw)
    session = int(s.group(1)) if s else None
    marker = "\nOutput:\n"
    idx = raw.find(marker)
    output = raw[idx + len(marker) :] if idx >= 0 else ""
    return ExecOutput(exit_code=code, session_id=session, output=output, raw=raw)


# === looking at the sandbox from outside the agent ===


class Probe:
    """The harness's own view of the agent's sandbox, through the plain `e2b` SDK."""

    def __init__(self, tools: List[Any], seen: Callable[[str], None]) -> None:
        self._tools = tools
        self._seen = seen

    @property
    def sandbox_id(self) -> str:
        # The sandbox tools are bound to the run's session; its state names the E2B sandbox.
        for tool in self._tools:
            session = getattr(tool, "session", None)
            state = getattr(session, "state", None)
            sid = getattr(state, "sandbox_id", None)
            if isinstance(sid, str) and sid:
                self._seen(sid)
                return sid
        raise AssertionError("no sandbox tool bound to a session was offered to the model")

    async def info(self) -> Any:
        from e2b import AsyncSandbox

        return await AsyncSandbox.get_info(
            self.sandbox_id, request_timeout=PROBE_REQUEST_TIMEOUT_S
        )

    async def _connect(self) -> Any:
        from e2b import AsyncSandbox

        return await AsyncSandbox.connect(
            self.sandbox_id, request_timeout=PROBE_REQUEST_TIMEOUT_S
        )

    async def read(self, path: str) -> bytes:
        sbx = await self._connect()
        data = await sbx.files.read(path, format="bytes", request_timeout=PROBE_REQUEST_TIMEOUT_S)
        return bytes(data)

    async def run(self, cmd: str) -> Any:
        sbx = await self._connect()
        return await sbx.commands.run(cmd, timeout=20, request_timeout=PROBE_REQUEST_TIMEOUT_S)


# === the model ===

Action = Union[TResponseOutputItem, Callable[[Probe], Awaitable[TResponseOutputItem]]]
Check = Callable[[str, Probe], Awaitable[None]]


@dataclass
class Step:
    """One model response: `action` is the item to answer with (or an async function of the
    probe that does some harness work first and returns it); `check` judges the tool output."""

    label: str
    action: Action
    check: Optional[Check] = None


@dataclass
class _Pending:
    step: Step
    call_id: str


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"[:200]


def _item_field(item: Any, name: str) -> Any:
    if isinstance(item, Mapping):
        return item.get(name)
    return getattr(item, name, None)


class ScriptedModel(Model):
    """Answers the Runner from a fixed list of steps."""

    def __init__(
        self, name: str, steps: List[Step], seen_sandbox: Callable[[str], None] = lambda _s: None
    ) -> None:
        self.name = name
        self._steps = list(steps)
        self._pending: Optional[_Pending] = None
        self._seen = seen_sandbox
        self.calls = 0
        #: One line per step: `PASS`, `FAIL` or `SENT` (a final message needs no check).
        self.trace: List[str] = []
        #: Tool outputs by call id, as the Runner handed them back.
        self.outputs: dict[str, str] = {}
        #: Sandbox ids the model's tools were bound to, in call order.
        self.sandbox_ids: List[str] = []

    @property
    def finished(self) -> bool:
        return not self._steps and self._pending is None

    def _record_sandbox(self, tools: List[Any]) -> None:
        probe = Probe(tools, self._seen)
        try:
            sid = probe.sandbox_id
        except AssertionError:
            return
        if not self.sandbox_ids or self.sandbox_ids[-1] != sid:
            self.sandbox_ids.append(sid)

    def _collect_outputs(self, input: Any) -> None:
        if isinstance(input, str):
            return
        for item in input:
            kind = _item_field(item, "type")
            if kind in ("function_call_output", "custom_tool_call_output"):
                call_id = _item_field(item, "call_id")
                out = _item_field(item, "output")
                if isinstance(out, list):  # structured output: its text and image URLs
                    out = "".join(
                        str(_item_field(p, "text") or _item_field(p, "image_url") or "")
                        for p in out
                    )
                self.outputs[str(call_id)] = str(out)

    async def get_response(
        self,
        system_instructions: Optional[str],
        input: Any,
        model_settings: Any,
        tools: List[Any],
        output_schema: Any,
        handoffs: List[Any],
        tracing: Any,
        *,
        previous_response_id: Optional[str] = None,
        conversation_id: Optional[str] = None,
        prompt: Any = None,
        **_future: Any,
    ) -> ModelResponse:
        self.calls += 1
        self._collect_outputs(input)
        self._record_sandbox(tools)
        probe = Probe(tools, self._seen)

        # Judge the previous step now that its output is back.
        if self._pending is not None:
            pending, self._pending = self._pending, None
            if pending.call_id not in self.outputs:
                self.trace.append(f"FAIL  {pending.step.label}: no tool output came back")
                raise AssertionError(
                    f"[{self.name}] step {pending.step.label!r}: the Runner returned no output "
                    f"for call {pending.call_id}"
                )
            if pending.step.check is not None:
                try:
                    await pending.step.check(self.outputs[pending.call_id], probe)
                except BaseException as e:
                    self.trace.append(f"FAIL  {pending.step.label}: {_first_line(e)}")
                    raise
            self.trace.append(f"PASS  {pending.step.label}")

        if not self._steps:
            raise AssertionError(f"[{self.name}] the Runner asked for more than the script holds")
        step = self._steps.pop(0)
        try:
            item = step.action(probe) if callable(step.action) else step.action
            if hasattr(item, "__await__"):
                item = await item  # type: ignore[misc]
        except BaseException as e:
            self.trace.append(f"FAIL  {step.label}: {_first_line(e)}")
            raise

        kind = _item_field(item, "type")
        if kind in ("function_call", "custom_tool_call"):
            name = _item_field(item, "name")
            offered = [getattr(t, "name", None) for t in tools]
            if name not in offered:
                self.trace.append(f"FAIL  {step.label}: tool {name!r} not offered")
                raise AssertionError(
                    f"[{self.name}] step {step.label!r} calls {name!r}, offered: {offered}"
                )
            self._pending = _Pending(step=step, call_id=str(_item_field(item, "call_id")))
        else:
            self.trace.append(f"SENT  {step.label}")
        return ModelResponse(output=[item], usage=Usage(requests=1), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        # The suite drives `Runner.run`, which only calls `get_response`.
        async def _never() -> AsyncIterator[Any]:
            raise NotImplementedError("ScriptedModel does not stream; use Runner.run")
            yield  # pragma: no cover  (makes this an async generator)

        return _never()
