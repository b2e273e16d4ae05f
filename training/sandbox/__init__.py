"""Run untrusted Python (model-written code) in a sandboxed interpreter.

Levels, strongest first (``levels.py``): ``bwrap`` and ``namespaces`` are boundaries, ``rlimits`` is not. Inside,
at every level, ``inside.py`` adds what the machine has: Landlock, a seccomp filter (``seccomp_filter.py``),
no-new-privileges, rlimits, a scratch working directory, a cleared environment; ``describe()`` names the level and
each piece in force (the tool's and the rollouts' metadata carry it). ``isolation_level()`` is the strongest level
that works here, probed by running a program at it (``BATCHRL_SANDBOX`` forces one, which must work); nothing falls
back silently: callers that run model code check ``weak_level_refusal``.

``run_python(program)``: one program, a fresh sandbox, everything killed and the scratch dir removed on return (the
code reward's). ``session.PythonSandbox``: one interpreter kept for a trajectory's cells (the python tool's).
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import tempfile
import time

from batchrl.common.environment_variables import EnvironmentVariableError, read
from batchrl.training.sandbox import levels, seccomp_filter
from batchrl.training.sandbox.launch import SandboxLimits, start
from batchrl.training.sandbox.levels import BOUNDARIES, LEVELS, is_boundary, weak_level_refusal
from batchrl.training.sandbox.streams import Stream, pump

__all__ = ["BOUNDARIES", "LEVELS", "SandboxLimits", "SandboxResult", "available", "describe", "is_boundary",
           "isolation_level", "run_python", "weak_level_refusal"]


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    returncode: int | None  # None when killed on timeout
    stdout: str
    stderr: str
    timed_out: bool
    isolation: str
    wall_s: float
    # killed because stdout or stderr passed max_output_bytes (a flood is cut at once, not kept in memory until the
    # timeout)
    output_truncated: bool = False


def kill(proc) -> None:
    """The process group, then the process reaped (PID-namespace levels take every descendant down with PID 1)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            try:
                stream.close()
            except OSError:
                pass


def run_python(program: str, *, stdin: str = "", limits: SandboxLimits = SandboxLimits(),
               isolation: str | None = None) -> SandboxResult:
    """Run ``program`` (Python source) in the sandbox with ``stdin``; never raises for anything the program does.
    The scratch directory is deleted and every process of the run killed before returning."""
    level = isolation or isolation_level()
    scratch = tempfile.mkdtemp(prefix="batchrl-sandbox-")
    started = time.monotonic()
    try:
        with open(os.path.join(scratch, "main.py"), "w") as f:
            f.write(program)
        proc = start(level, scratch, limits, "run")
        out, err = (Stream(stream.fileno(), limits.max_output_bytes) for stream in (proc.stdout, proc.stderr))
        if not stdin:
            proc.stdin.close()
        outcome = pump([out, err], started + limits.timeout_s,
                       (proc.stdin, stdin.encode()) if stdin else None)
        if outcome == "done":
            try:
                proc.wait(timeout=max(0.0, started + limits.timeout_s - time.monotonic()))
            except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired: streams closed, process still running
                outcome = "timeout"
        kill(proc)
        timed_out = outcome == "timeout"
        return SandboxResult(None if timed_out else proc.returncode, out.text(), err.text(), timed_out, level,
                             time.monotonic() - started, output_truncated=outcome == "over")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


_PROBED: dict[str, tuple[bool, str]] = {}


def probe(level: str) -> tuple[bool, str]:
    """Whether ``level`` works here and, if not, why (probed once per process by running a program at it:
    namespaces may be forbidden even where the binary exists, e.g. in some containers)."""
    if level not in _PROBED:
        if level == "bwrap" and levels.bwrap_binary()[0] is None:
            _PROBED[level] = (False, levels.bwrap_binary()[1])
        elif level == "namespaces" and not shutil.which("unshare"):
            _PROBED[level] = (False, "no unshare (util-linux) on PATH")
        else:
            result = run_python("print('ok')", limits=SandboxLimits(timeout_s=10.0), isolation=level)
            works = result.stdout == "ok\n" and result.returncode == 0
            _PROBED[level] = (works, "works" if works else f"exit {result.returncode}: {result.stderr.strip()[-300:]}")
    return _PROBED[level]


def available(level: str) -> bool:
    return level in LEVELS and probe(level)[0]


def isolation_level() -> str:
    """``BATCHRL_SANDBOX`` if set (it must work here), else the strongest level that works."""
    try:
        forced = read("BATCHRL_SANDBOX")  # one of LEVELS (the table's choices)
    except EnvironmentVariableError as error:  # not a level: refused as one that does not work here
        raise RuntimeError(str(error)) from None
    if forced:
        if not available(forced):
            raise RuntimeError(f"BATCHRL_SANDBOX={forced!r} is not available here ({probe(forced)[1]})")
        return forced
    return next(level for level in LEVELS if available(level))


def describe(level: str | None = None, limits: SandboxLimits = SandboxLimits()) -> dict:
    """The level and each piece in force, for metadata (``sandbox/...`` keys of the tool and the rollouts)."""
    level = level or isolation_level()
    landlock = levels.landlock_abi()
    seccomp_missing = seccomp_filter.unavailable_reason()
    pieces = {
        "level": level, "boundary": is_boundary(level),
        "namespaces": {"bwrap": "user pid net ipc uts cgroup mount (minimal read-only root)",
                       "namespaces": "user pid net mount ipc uts (tmpfs over storage, Dagster home, $HOME, /tmp, "
                                     "/dev; rest read-only; capabilities dropped)"}.get(level, "none"),
        "landlock": f"ABI {landlock}" if landlock else "unavailable (kernel)",
        "seccomp": (f"on: {len(seccomp_filter.DENIED) + 4} calls refused (libseccomp via pyseccomp)"
                    if seccomp_missing is None else f"unavailable: {seccomp_missing}"),
        "rlimits": (f"as {limits.memory_mb} MiB, cpu {limits.cpu_s or limits.timeout_s + 1:g} s, fsize "
                    f"{limits.file_size_mb} MiB, nofile {limits.open_files}, nproc {limits.processes}"
                    + (" (not enforced for a root-owned sandbox; seccomp refuses new processes)"
                       if os.geteuid() == 0 else "")),
        "scratch": "a private working directory per sandbox, removed with it",
        "environment": "cleared (PATH, HOME, TMPDIR, LANG only)",
    }
    if level == "bwrap":
        pieces["bwrap"] = " ".join(str(x) for x in levels.bwrap_binary())
    if level == "rlimits":
        pieces["audit_hook"] = "on (files, processes, ctypes, signals, sockets)"
    return pieces
