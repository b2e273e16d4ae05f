"""Code-execution reward: run the response's program against the row's tests in the sandbox.

``meta["tests"]`` (a list/dict or its JSON text) is either

- a list of Python test statements (MBPP style: ``["assert add(1, 2) == 3", ...]``): each runs in its
  own sandboxed process after the response's code; it passes when the process exits 0 and prints
  the run's nonce, which the harness reads from stdin before the solution runs, so a solution that
  exits early (``sys.exit(0)``, ``os._exit``) does not pass. (It guards against early exits, not
  against a program that inspects the harness's frames: the sandbox, not the harness, is the
  security boundary.)
- ``{"inputs": [...], "outputs": [...]}`` (stdin/stdout style, APPS/CodeContests): a case passes
  when the program exits 0 and its output equals the expected one up to whitespace.

The reward is the pass fraction in [0, 1]; no tests, no code, a crash, a timeout or anything the
sandbox refuses count as failures. Isolation and limits: ``training/sandbox/``.
"""
from __future__ import annotations

import json
import os
import re
import secrets
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from batchrl.training import sandbox
from batchrl.training.rewards.registry import register_reward

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)
LIMITS = sandbox.SandboxLimits(timeout_s=5.0, memory_mb=512)

_HARNESS = """\
import sys
def _batchrl_run(solution, test):
    nonce = sys.stdin.readline().strip()
    scope = {{"__name__": "__main__"}}
    exec(compile(solution, "solution.py", "exec"), scope)
    exec(compile(test, "test.py", "exec"), scope)
    sys.stdout.write("\\n" + nonce + "\\n")
    sys.stdout.flush()
_batchrl_run({solution!r}, {test!r})
"""


def extract_code(response: str) -> str:
    """The last fenced Python block of the response (```python / ```py / plain ```), else the
    whole response."""
    blocks = _FENCE.findall(response)
    python = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3")]
    chosen = python or [body for lang, body in blocks if not lang]
    return chosen[-1] if chosen else response


def parse_tests(tests: Any) -> list[str] | dict[str, list[str]] | None:
    """Normalise ``meta["tests"]``: JSON text decoded; arrays (numpy/pyarrow) to lists."""
    if tests is None or isinstance(tests, float):  # a missing cell (None/NaN)
        return None
    if isinstance(tests, str):
        tests = json.loads(tests)
    if isinstance(tests, dict):
        inputs, outputs = (list(tests[k]) if tests.get(k) is not None else [] for k in ("inputs", "outputs"))
        if len(inputs) != len(outputs):
            raise ValueError(f"tests have {len(inputs)} inputs but {len(outputs)} outputs")
        return {"inputs": [str(x) for x in inputs], "outputs": [str(x) for x in outputs]}
    return [str(t) for t in tests]


def _assert_case(code: str, test: str, limits: sandbox.SandboxLimits) -> bool:
    nonce = secrets.token_hex(16)
    result = sandbox.run_python(_HARNESS.format(solution=code, test=test), stdin=nonce + "\n", limits=limits)
    lines = result.stdout.rstrip("\n").splitlines()
    return result.returncode == 0 and bool(lines) and lines[-1] == nonce


def _io_case(code: str, given: str, expected: str, limits: sandbox.SandboxLimits) -> bool:
    result = sandbox.run_python(code, stdin=given, limits=limits)
    return result.returncode == 0 and result.stdout.split() == expected.split()


def code_pass_fraction(code: str, tests: Any, limits: sandbox.SandboxLimits = LIMITS) -> float:
    """Fraction of ``tests`` (see the module docstring) that ``code`` passes; cases run in parallel
    sandboxes (one per CPU)."""
    parsed = parse_tests(tests)
    if not parsed or not code.strip():
        return 0.0
    if isinstance(parsed, dict):
        jobs = [(_io_case, (code, i, o, limits)) for i, o in zip(parsed["inputs"], parsed["outputs"])]
    else:
        jobs = [(_assert_case, (code, t, limits)) for t in parsed]
    if not jobs:
        return 0.0
    with ThreadPoolExecutor(max_workers=min(len(jobs), os.cpu_count() or 1)) as pool:
        passed = list(pool.map(lambda job: job[0](*job[1]), jobs))
    return sum(passed) / len(passed)


@register_reward("code_exec", needs=("tests",))
def code_exec(prompt: str, response: str, meta: dict) -> float:
    """Pass fraction of the response's code (``extract_code``) on ``meta["tests"]``, run in the
    sandbox with ``LIMITS`` (5 s, 512 MiB per case); 0.0 without tests."""
    return code_pass_fraction(extract_code(response), meta.get("tests"), LIMITS)
