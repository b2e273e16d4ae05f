"""Tool calls: finding them in a model turn, running them, turning the result into an observation.

**Python keeps its state in one interpreter per trajectory** (``python_state: persistent``, the default): the
trajectory's first call starts a sandboxed interpreter (``training/sandbox``: the strongest level here, Landlock,
seccomp, rlimits, a scratch dir), later calls run their cell in it, and it is killed with its scratch dir when the
trajectory ends. A cell that hangs or floods kills it; the next call starts a fresh one and silently replays the
cells kept so far first, so such a cell is left out of the state as before. ``python_state: replay`` is the former
way: every call a fresh sandbox that re-runs the earlier cells with their output discarded, then the new cell
(``tests/test_sandbox_session.py`` checks both give the same observations on the tool task).

Model code runs only at a sandbox level that is a boundary (bwrap or namespaces) unless the config says
``allow_weak_sandbox: true``: ``ToolBox`` refuses with one line naming the level and why before anything runs.

**User tools** (``module:function``) are trusted code run in this process: ``function(arguments, state)`` with
``state`` a dict of this rollout's own; an exception becomes an observation, a call past ``tool_timeout_s`` is
reported as timed out (its thread cannot be killed and finishes in the background).
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor, TimeoutError as FutureTimeout
from typing import Any, Callable

from batchrl.training import sandbox
from batchrl.training.agent.config import AgentConfig
from batchrl.training.sandbox.session import PythonSandbox

_PYTHON_BLOCK = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

# statuses of a tool result (schemas/trajectory.py): ok; error (non-zero exit, an exception); timeout;
# output_limit (a flood, killed); invalid (an unreadable call); unknown_tool


@dataclasses.dataclass
class ToolCall:
    name: str
    arguments: dict
    end: int  # index in the turn's text just past the call: the turn is cut there
    error: str | None = None  # why the call could not be read (an observation, not a crash)

    @property
    def text(self) -> str:
        """What the call asks, as recorded in the rollouts (the code for python)."""
        return self.arguments.get("code", "") if self.name == "python" else json.dumps(self.arguments, sort_keys=True)


@dataclasses.dataclass
class ToolResult:
    output: str
    exit_code: int | None
    status: str
    wall_s: float


def find_tool_call(text: str, tool_format: str) -> ToolCall | None:
    """The first tool call in a model turn's ``text`` in ``tool_format``, or None."""
    if tool_format == "python_block":
        match = _PYTHON_BLOCK.search(text)
        return None if match is None else ToolCall("python", {"code": match.group(1)}, match.end())
    match = _TOOL_CALL.search(text)
    if match is None:
        return None
    try:
        body = json.loads(match.group(1))
        name, arguments = body["name"], body.get("arguments", {})
        if not isinstance(name, str) or not isinstance(arguments, dict):
            raise TypeError("name must be a string and arguments an object")
    except (ValueError, KeyError, TypeError) as exc:
        return ToolCall("", {}, match.end(), error=f"invalid tool call: {exc}")
    return ToolCall(name, arguments, match.end())


# the replayed program, run by the sandbox's own first module (training/sandbox/inside.py, ``__main__`` there), whose
# cell runner the persistent interpreter uses too: the same echo, traceback and exit-status rules in both
_REPLAY = r'''
import sys as _sys
_boot, _streams, _scope = _sys.modules["__main__"], (_sys.stdout, _sys.stderr), {"__name__": "__main__"}
for _i, _cell in enumerate(%(earlier)r):
    _boot.cell(_scope, {"cell": _cell, "name": "<cell %%d>" %% (_i + 1), "silent": True}, _streams)
    _sys.stdout, _sys.stderr = _streams
_sys.exit(_boot.cell(_scope, {"cell": %(cell)r, "name": "<cell %(number)d>"}, _streams))
'''


def _tool_result(result: sandbox.SandboxResult, limits: sandbox.SandboxLimits) -> tuple[ToolResult, bool]:
    """The observation of a sandboxed cell and whether the cell is kept in the state (a hang or a flood is not: it
    would repeat)."""
    if result.timed_out:
        status, note = "timeout", f"[timed out after {limits.timeout_s:g} s: the process was killed]"
    elif result.output_truncated:
        status, note = "output_limit", f"[output passed {limits.max_output_bytes} bytes: the process was killed]"
    else:
        status, note = ("ok" if result.returncode == 0 else "error"), ""
    output = result.stdout + result.stderr + (("\n" if result.stdout or result.stderr else "") + note if note else "")
    return ToolResult(output, result.returncode, status, result.wall_s), status in ("ok", "error")


class ReplaySession:
    """One rollout's Python by replay: the cells run so far (those that did not hang or flood) re-run each call."""

    def __init__(self, limits: sandbox.SandboxLimits, level: str) -> None:
        self.limits, self.level = limits, level
        self.cells: list[str] = []

    def run(self, code: str) -> ToolResult:
        program = _REPLAY % {"earlier": list(self.cells), "cell": code, "number": len(self.cells) + 1}
        observation, kept = _tool_result(sandbox.run_python(program, limits=self.limits, isolation=self.level),
                                         self.limits)
        if kept:
            self.cells.append(code)
        return observation

    def close(self) -> None:
        pass


class PersistentSession:
    """One rollout's Python in one sandboxed interpreter kept between its calls (``training/sandbox/session.py``)."""

    def __init__(self, limits: sandbox.SandboxLimits, level: str) -> None:
        self.limits = limits
        self.box = PythonSandbox(level, limits)
        self.box.start()  # boots while the trajectory's first turn is generated, off the tool calls' path

    def run(self, code: str) -> ToolResult:
        return _tool_result(self.box.run(code, f"<cell {len(self.box.kept) + 1}>"), self.limits)[0]

    def close(self) -> None:
        self.box.close()


SESSIONS = {"persistent": PersistentSession, "replay": ReplaySession}


def load_user_tool(name: str, spec: str) -> Callable[[dict, dict], Any]:
    """``module:function`` imported, or a clear error naming the config field."""
    module_name, _, attr = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"agent.tools.{name}: cannot import {spec!r}: {exc}") from None
    if not callable(fn):
        raise ValueError(f"agent.tools.{name}: {spec!r} is not callable")
    return fn


class ToolBox:
    """The tools of one agent run and each rollout's state (``session(key)``: Python cells and a user-tool dict)."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.level = sandbox.isolation_level()
        refusal = sandbox.weak_level_refusal(self.level, config.allow_weak_sandbox, "agent")
        if refusal:
            raise RuntimeError(refusal)
        # a persistent interpreter's CPU limit covers the trajectory's calls (the wall clock is per call)
        self.limits = sandbox.SandboxLimits(timeout_s=config.tool_timeout_s, memory_mb=config.tool_memory_mb,
                                            max_output_bytes=config.tool_output_bytes,
                                            cpu_s=config.tool_timeout_s * config.max_turns)
        self.sandbox = sandbox.describe(self.level, self.limits)
        self.user_tools = {name: load_user_tool(name, spec) for name, spec in config.tools.items()}
        self._user_pool = ThreadPoolExecutor(max_workers=config.tool_workers) if self.user_tools else None

    def new_state(self) -> dict:
        """A rollout's own state: nothing in it is shared with another rollout."""
        return {"python": SESSIONS[self.config.python_state](self.limits, self.level), "user": {}}

    @staticmethod
    def close_state(state: dict) -> None:
        """End a rollout's Python (its interpreter killed, its scratch dir removed)."""
        if "python" in state:
            state["python"].close()

    def run(self, call: ToolCall, state: dict) -> ToolResult:
        """Run ``call``; never raises: whatever goes wrong is the observation."""
        started = time.perf_counter()
        if call.error is not None:
            return ToolResult(call.error, None, "invalid", 0.0)
        if call.name == "python":
            code = call.arguments.get("code")
            if not isinstance(code, str):
                return ToolResult('invalid tool call: python needs arguments {"code": "..."}', None, "invalid", 0.0)
            return state["python"].run(code)
        fn = self.user_tools.get(call.name)
        if fn is None:
            known = ["python", *self.user_tools]
            return ToolResult(f"unknown tool {call.name!r}; tools: {known}", None, "unknown_tool", 0.0)
        future = self._user_pool.submit(fn, call.arguments, state["user"])
        try:
            value = future.result(timeout=self.config.tool_timeout_s)
        except FutureTimeout:
            return ToolResult(f"[timed out after {self.config.tool_timeout_s:g} s]", None, "timeout",
                              time.perf_counter() - started)
        except Exception as exc:  # a user tool's failure is the model's observation, never the stage's crash
            return ToolResult(f"{type(exc).__name__}: {exc}", 1, "error", time.perf_counter() - started)
        return ToolResult(value if isinstance(value, str) else json.dumps(value, default=str), 0, "ok",
                          time.perf_counter() - started)


def observation_text(result: ToolResult, max_chars: int) -> tuple[str, bool]:
    """The observation shown to the model (``(no output)`` when empty) and whether it was cut: longer than
    ``max_chars``, its head and tail are kept around a marker saying how much was dropped."""
    text = result.output.rstrip("\n") or "(no output)"
    if len(text) <= max_chars:
        return text, False
    marker = f"\n...[{len(text) - max_chars} characters cut]...\n"
    keep = max(0, max_chars - len(marker))
    return text[:keep - keep // 4] + marker + text[len(text) - keep // 4:], True
