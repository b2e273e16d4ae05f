"""Starting a sandboxed interpreter at a level: its command, its environment, the plan ``inside.py`` applies.

``start`` makes the process; ``run_python`` (one program, stdin in, output out) and ``session.PythonSandbox`` (one
interpreter kept for a trajectory's cells) drive it.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pwd
import shutil
import subprocess
import sys

from batchrl.training.sandbox import levels, seccomp_filter

SCRATCH_IN_BWRAP = "/sandbox"
_HERE = os.path.dirname(os.path.abspath(__file__))
_SYSTEM = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc/localtime", "/etc/ld.so.cache")
_DEVICES_READ = ("/dev/zero", "/dev/urandom", "/dev/random")


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """``timeout_s`` wall clock of a run or a cell; ``memory_mb`` address space; ``file_size_mb`` largest file
    written; ``max_output_bytes`` of stdout/stderr kept (past it the process is killed); ``processes`` the
    sandbox's process limit; ``cpu_s`` CPU seconds of the whole process (default: ``timeout_s`` + 1; a persistent
    interpreter gets the trajectory's budget)."""

    timeout_s: float = 5.0
    memory_mb: int = 512
    file_size_mb: int = 16
    open_files: int = 64
    max_output_bytes: int = 65536
    processes: int = 16
    cpu_s: float | None = None


def interpreter() -> tuple[str, str]:
    """The real interpreter binary (not a venv link) and its install prefix (stdlib)."""
    return os.path.realpath(sys.executable), os.path.realpath(sys.base_prefix)


def hidden_paths() -> list[str]:
    """What a namespaces-level sandbox covers with an empty tmpfs: the storage root, the Dagster home, $HOME (and
    the user's home as the password database has it), /tmp."""
    from batchrl.common.storage_layout import local_storage_root

    found = [local_storage_root(), os.environ.get("DAGSTER_HOME"), os.path.expanduser("~"),
             pwd.getpwuid(os.getuid()).pw_dir, "/tmp"]
    paths = []
    for path in found:
        real = path and os.path.realpath(path)
        if real and os.path.isdir(real) and real != "/" and real not in paths:
            paths.append(real)
    return paths


def _bwrap_command(binary: str, scratch: str, prefix: str, mode: str) -> list[str]:
    # --die-with-parent fires when the *thread* that started it ends: a persistent interpreter started from a tool
    # thread pool would die with the pool's thread, so only one-shot runs take it. No --new-session: every bwrap
    # process stays in the process group Popen made (its own session, no terminal), so killing the group kills the
    # namespace's init and with it everything inside, whatever group the model's code moved to
    cmd = [binary, "--unshare-all", "--cap-drop", "ALL", *(["--die-with-parent"] if mode == "run" else []),
           "--clearenv",
           "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", SCRATCH_IN_BWRAP, "--setenv", "TMPDIR",
           SCRATCH_IN_BWRAP, "--setenv", "LANG", "C.UTF-8",
           "--ro-bind", "/usr", "/usr", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    for top in ("/bin", "/lib", "/lib64", "/lib32", "/sbin"):
        if os.path.islink(top):
            cmd += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            cmd += ["--ro-bind", top, top]
    if not prefix.startswith("/usr/"):
        cmd += ["--ro-bind", prefix, prefix]
    return cmd + ["--bind", scratch, SCRATCH_IN_BWRAP, "--chdir", SCRATCH_IN_BWRAP]


NAMESPACES = ["unshare", "--user", "--map-root-user", "--net", "--pid", "--mount", "--ipc", "--uts", "--fork",
              "--kill-child", "--mount-proc"]


def _plan(level: str, scratch: str, prefix: str, limits: SandboxLimits, mode: str) -> dict:
    """What ``inside.py`` applies before the model's code runs (paths as the sandboxed process sees them)."""
    cwd = SCRATCH_IN_BWRAP if level == "bwrap" else scratch
    plan: dict = {"mode": mode, "cwd": cwd, "limits": _rlimits(limits)}
    if level == "namespaces":
        hide = hidden_paths()
        plan["mounts"] = {"hide": hide, "scratch": scratch,
                          "keep": [prefix] if any(prefix.startswith(h + "/") for h in hide) else []}
    if levels.landlock_abi() > 0:
        plan["landlock"] = {"read": [*_SYSTEM, prefix, *_DEVICES_READ], "write": [cwd, "/dev/null"]}
    if seccomp_filter.unavailable_reason() is None:
        seccomp_filter.write_program(scratch)
        plan["seccomp"] = os.path.join(cwd, ".seccomp.bpf")
    return plan


def _rlimits(limits: SandboxLimits) -> dict[str, int]:
    """The rlimits ``inside.py`` sets on itself before the model's code (soft = hard: the code cannot raise them)."""
    cpu = int(limits.cpu_s if limits.cpu_s is not None else limits.timeout_s) + 1
    return {"RLIMIT_AS": limits.memory_mb * 2**20, "RLIMIT_CPU": cpu, "RLIMIT_FSIZE": limits.file_size_mb * 2**20,
            "RLIMIT_NOFILE": limits.open_files, "RLIMIT_CORE": 0, "RLIMIT_NPROC": limits.processes}


def start(level: str, scratch: str, limits: SandboxLimits, mode: str, pass_fds: tuple[int, ...] = (),
          control: tuple[int, int] | None = None) -> subprocess.Popen:
    """The sandboxed interpreter at ``level`` in ``scratch`` (which holds ``main.py`` for ``mode`` ``run``), its
    process group its own (``os.killpg(proc.pid, SIGKILL)`` ends all of it)."""
    binary, prefix = interpreter()
    shutil.copyfile(os.path.join(_HERE, "inside.py"), os.path.join(scratch, "boot.py"))
    plan = _plan(level, scratch, prefix, limits, mode)
    if control:
        plan["control"] = list(control)
    if level == "rlimits":  # no namespaces: an audit hook in the interpreter is one more (Python-level) wall
        plan["audit_guard"] = True
    py = [binary, "-I", "-S", "-B", "boot.py", json.dumps(plan)]
    if level == "bwrap":
        cmd = _bwrap_command(levels.bwrap_binary()[0] or "bwrap", scratch, prefix, mode) + py
    elif level == "namespaces":
        cmd = NAMESPACES + py
    else:
        cmd = py
    env = {"PATH": "/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8"}
    return subprocess.Popen(cmd, cwd=scratch, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True, pass_fds=pass_fds)
