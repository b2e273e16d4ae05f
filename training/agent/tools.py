"""Tool calls: finding them in a model turn, running them, turning the result into an observation.

**Python keeps its state by replaying.** Each call runs in a fresh sandbox (``training/sandbox.py``, the one the
code reward uses: bubblewrap, no network, rlimits, a scratch dir deleted afterwards) a program that first re-runs the
rollout's earlier cells with their output discarded, then the new cell, echoing its last expression as a REPL does.
Why not a persistent interpreter per rollout: every call keeps the sandbox's guarantees unchanged (fresh process,
fresh limits, nothing left running between turns or after the rollout), a cell that hung or flooded cannot poison
the next one (it is left out of the replay), and there is nothing to clean up or to leak between rollouts. The cost
is re-running earlier cells (tiny for a few turns of arithmetic; it counts against ``tool_timeout_s``), and state that
is not a function of the code (time, randomness, files written outside the scratch dir) is not kept.

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


_REPLAY = r'''
import ast as _ast, sys as _sys, traceback as _tb
class _Discard:
    def write(self, text): return len(text)
    def flush(self): pass
_scope = {"__name__": "__main__"}
def _run(source, name, echo):
    tree = _ast.parse(source, name)
    last = tree.body.pop() if echo and tree.body and isinstance(tree.body[-1], _ast.Expr) else None
    exec(compile(tree, name, "exec"), _scope)
    if last is not None:
        value = eval(compile(_ast.Expression(last.value), name, "eval"), _scope)
        if value is not None:
            print(repr(value))
_stdout, _stderr = _sys.stdout, _sys.stderr
_sys.stdout = _sys.stderr = _Discard()
for _i, _cell in enumerate(%(earlier)r):
    try:
        _run(_cell, "<cell %%d>" %% (_i + 1), False)
    except BaseException:
        pass
_sys.stdout, _sys.stderr = _stdout, _stderr
try:
    _run(%(cell)r, "<cell %(number)d>", True)
except SystemExit:
    raise
except BaseException as _e:
    _trace = _e.__traceback__
    while _trace is not None and not _trace.tb_frame.f_code.co_filename.startswith("<cell"):
        _trace = _trace.tb_next
    _tb.print_exception(type(_e), _e, _trace)
    _sys.exit(1)
'''


class PythonSession:
    """One rollout's Python: the cells run so far (those that did not hang or flood) and the sandbox limits."""

    def __init__(self, limits: sandbox.SandboxLimits) -> None:
        self.limits = limits
        self.cells: list[str] = []

    def run(self, code: str) -> ToolResult:
        program = _REPLAY % {"earlier": list(self.cells), "cell": code, "number": len(self.cells) + 1}
        result = sandbox.run_python(program, limits=self.limits)
        if result.timed_out:
            status, note = "timeout", f"[timed out after {self.limits.timeout_s:g} s: the process was killed]"
        elif result.output_truncated:
            status, note = "output_limit", (f"[output passed {self.limits.max_output_bytes} bytes: the process was "
                                            "killed]")
        else:
            status, note = ("ok" if result.returncode == 0 else "error"), ""
        if status in ("ok", "error"):  # replayed by later calls; a hang or a flood would repeat there
            self.cells.append(code)
        output = result.stdout + result.stderr + (("\n" if result.stdout or result.stderr else "") + note if note
                                                  else "")
        return ToolResult(output, result.returncode, status, result.wall_s)


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
        self.limits = sandbox.SandboxLimits(timeout_s=config.tool_timeout_s, memory_mb=config.tool_memory_mb,
                                            max_output_bytes=config.tool_output_bytes)
        self.user_tools = {name: load_user_tool(name, spec) for name, spec in config.tools.items()}
        self._user_pool = ThreadPoolExecutor(max_workers=config.tool_workers) if self.user_tools else None

    def new_state(self) -> dict:
        """A rollout's own state: nothing in it is shared with another rollout."""
        return {"python": PythonSession(self.limits), "user": {}}

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
