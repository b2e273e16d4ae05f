"""Run untrusted Python (model-written code) in a sandboxed subprocess.

Every run gets a fresh scratch directory (removed afterwards), a wall-clock timeout after which the
whole process tree is killed, and rlimits on address space (memory), CPU time, file size and open
files. Isolation, strongest available first (``isolation_level()``; ``BATCHRL_SANDBOX`` forces one):

- ``bwrap`` (bubblewrap, Debian package ``bubblewrap``; ``scripts/bootstrap.sh`` installs it when
  run as root): new mount, PID, network, IPC, UTS, user and cgroup namespaces. The program sees only
  the read-only system (/usr and the interpreter's install tree), an empty /tmp, and the scratch dir
  as its working directory: files elsewhere do not exist for it, there is no network interface but
  loopback, and its processes die with the sandbox's PID 1.
- ``unshare`` (weaker, util-linux): new user, PID and network namespaces (no network, the process
  tree dies with it) but the host file system is visible; an audit hook in the interpreter refuses
  opening files outside the scratch dir (and the read-only stdlib) and starting processes. Audit
  hooks are not a security boundary (ctypes can bypass them; ctypes is refused too, but native code
  paths remain): use this only where bubblewrap cannot be installed.
- ``rlimits`` (weakest): only the audit hook, rlimits, timeout and scratch dir; the audit hook also
  refuses sockets.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

LEVELS = ("bwrap", "unshare", "rlimits")
_SCRATCH_IN_SANDBOX = "/sandbox"


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """``timeout_s`` wall clock; ``memory_mb`` address space; ``file_size_mb`` largest file written;
    ``max_output_bytes`` of stdout/stderr kept."""

    timeout_s: float = 5.0
    memory_mb: int = 512
    file_size_mb: int = 16
    open_files: int = 64
    max_output_bytes: int = 65536


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    returncode: int | None  # None when killed on timeout
    stdout: str
    stderr: str
    timed_out: bool
    isolation: str
    wall_s: float
    # killed because stdout or stderr passed max_output_bytes (a flood is cut at once, not kept in memory
    # until the timeout)
    output_truncated: bool = False


def _works(cmd: list[str]) -> bool:
    try:
        return subprocess.run(cmd, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


_PROBED: dict[str, bool] = {}
_WARNED: list[str] = []


def available(level: str) -> bool:
    """Whether ``level`` works on this machine (probed once: namespaces may be forbidden even when
    the binary exists, e.g. in some containers)."""
    if level not in _PROBED:
        if level == "bwrap":
            _PROBED[level] = bool(shutil.which("bwrap")) and _works(
                ["bwrap", "--ro-bind", "/", "/", "--unshare-all", "--die-with-parent", "true"])
        elif level == "unshare":
            _PROBED[level] = bool(shutil.which("unshare")) and _works(
                ["unshare", "--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child", "true"])
        else:
            _PROBED[level] = level == "rlimits"
    return _PROBED[level]


def isolation_level() -> str:
    """``BATCHRL_SANDBOX`` if set (must be available), else the strongest available level."""
    forced = os.environ.get("BATCHRL_SANDBOX")
    if forced:
        if forced not in LEVELS or not available(forced):
            raise RuntimeError(f"BATCHRL_SANDBOX={forced!r} is not available here (levels: {LEVELS})")
        return forced
    level = next(level for level in LEVELS if available(level))
    if level != "bwrap" and not _WARNED:
        _WARNED.append(level)
        logging.getLogger(__name__).warning(
            "sandbox: bubblewrap unavailable, running model code with the weaker %r isolation "
            "(install the Debian package bubblewrap)", level)
    return level


def _interpreter() -> tuple[str, str]:
    """The real interpreter binary (not a venv link) and its install prefix (stdlib)."""
    return os.path.realpath(sys.executable), os.path.realpath(sys.base_prefix)


def _bwrap_prefix(scratch: str, prefix: str) -> list[str]:
    cmd = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--clearenv",
           "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", _SCRATCH_IN_SANDBOX,
           "--ro-bind", "/usr", "/usr", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    for top in ("/bin", "/lib", "/lib64", "/lib32", "/sbin"):
        if os.path.islink(top):
            cmd += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            cmd += ["--ro-bind", top, top]
    if not prefix.startswith("/usr/"):
        cmd += ["--ro-bind", prefix, prefix]
    return cmd + ["--bind", scratch, _SCRATCH_IN_SANDBOX, "--chdir", _SCRATCH_IN_SANDBOX]


# Python-level guard for the weaker levels: stdlib read-only, scratch dir read-write, nothing else.
_AUDIT_GUARD = r'''
import os as _os, sys as _sys
def _batchrl_guard(_root=_os.path.realpath(_os.getcwd()), _stdlib=_os.path.realpath(_sys.base_prefix),
                   _deny_net=%(deny_net)r, _os=_os):
    def inside(path, *tops):
        path = _os.path.realpath(_os.fsdecode(path))
        return any(path == top or path.startswith(top + _os.sep) for top in tops)
    def hook(event, args):
        if event == "open" and args and not isinstance(args[0], int):
            mode, flags = (list(args[1:3]) + [None, None])[:2]
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool(
                (flags or 0) & (_os.O_WRONLY | _os.O_RDWR | _os.O_CREAT))
            if not inside(args[0], _root) and (writing or not inside(args[0], _stdlib)):
                raise PermissionError(f"sandbox: {args[0]} is outside the sandbox")
        elif event in ("os.listdir", "os.scandir", "os.chdir") and args and isinstance(args[0], (str, bytes)):
            if not inside(args[0], _root, _stdlib):
                raise PermissionError(f"sandbox: {event} outside the sandbox")
        elif event in ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.symlink", "os.link",
                       "os.chmod", "os.truncate") and args and isinstance(args[0], (str, bytes)):
            if not inside(args[0], _root) or (len(args) > 1 and isinstance(args[1], (str, bytes))
                                              and not inside(args[1], _root)):
                raise PermissionError(f"sandbox: {event} outside the sandbox")
        elif event.startswith(("subprocess.", "os.exec", "os.posix_spawn", "os.system", "os.fork",
                               "os.forkpty", "ctypes.", "os.kill", "os.killpg", "pty.")) or (
                _deny_net and event.startswith("socket.")):
            raise PermissionError(f"sandbox: {event} is not allowed")
    return hook
_sys.addaudithook(_batchrl_guard())
del _batchrl_guard
'''


def _set_limits(limits: SandboxLimits):
    def apply() -> None:
        mem = limits.memory_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        cpu = int(limits.timeout_s) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        size = limits.file_size_mb * 2**20
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return apply


def run_python(program: str, *, stdin: str = "", limits: SandboxLimits = SandboxLimits(),
               isolation: str | None = None) -> SandboxResult:
    """Run ``program`` (Python source) in the sandbox with ``stdin``; never raises for anything the
    program does. The scratch directory is deleted and every process of the run killed before
    returning."""
    level = isolation or isolation_level()
    interpreter, prefix = _interpreter()
    scratch = tempfile.mkdtemp(prefix="batchrl-sandbox-")
    try:
        source = program if level == "bwrap" else _AUDIT_GUARD % {"deny_net": level == "rlimits"} + program
        with open(os.path.join(scratch, "main.py"), "w") as f:
            f.write(source)
        py = [interpreter, "-I", "-S", "-B", "main.py"]
        if level == "bwrap":
            cmd = _bwrap_prefix(scratch, prefix) + py
        elif level == "unshare":
            cmd = ["unshare", "--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child"] + py
        else:
            cmd = py
        env = {"PATH": "/usr/bin:/bin", "HOME": scratch, "LANG": "C.UTF-8"}
        return _run(cmd, scratch, env, stdin, limits, level)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _run(cmd, cwd, env, stdin, limits, level) -> SandboxResult:
    """Run ``cmd`` until it exits, its wall clock runs out or one of its streams passes ``max_output_bytes``
    (then the process tree is killed: a print loop would otherwise fill the caller's memory until the timeout)."""
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True, preexec_fn=_set_limits(limits))
    cut = limits.max_output_bytes
    kept: dict[str, list[bytes]] = {"out": [], "err": []}
    seen = {"out": 0, "err": 0}
    over, stop = threading.Event(), threading.Event()

    def drain(stream, key: str) -> None:
        while data := stream.read1(65536):
            if seen[key] < cut:
                kept[key].append(data[:cut - seen[key]])
            seen[key] += len(data)
            if seen[key] > cut:
                over.set()
                stop.set()
                return

    def feed() -> None:
        try:
            proc.stdin.write(stdin.encode())
            proc.stdin.close()
        except OSError:  # the program exited (or was killed) without reading all of it
            pass

    def wait() -> None:
        proc.wait()
        stop.set()

    threads = [threading.Thread(target=drain, args=(proc.stdout, "out"), daemon=True),
               threading.Thread(target=drain, args=(proc.stderr, "err"), daemon=True),
               threading.Thread(target=feed, daemon=True), threading.Thread(target=wait, daemon=True)]
    for thread in threads:
        thread.start()
    timed_out = not stop.wait(limits.timeout_s)
    try:  # the session's group; PID-namespace levels also take every descendant down with PID 1
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    for thread in threads[:2]:
        thread.join(timeout=1.0)
    for stream in (proc.stdout, proc.stderr, proc.stdin):
        with contextlib.suppress(OSError):
            stream.close()
    text = {key: b"".join(parts)[:cut].decode(errors="replace") for key, parts in kept.items()}
    return SandboxResult(None if timed_out else proc.returncode, text["out"], text["err"], timed_out, level,
                         time.perf_counter() - started, output_truncated=over.is_set())
