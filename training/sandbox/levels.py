"""Which isolation a sandbox gets here, what each level is made of, and whether it is a boundary.

- ``bwrap`` (boundary): bubblewrap's user, PID, network, IPC, UTS and cgroup namespaces over a minimal read-only root
  (the system's /usr and the interpreter's install tree), an empty /tmp and the scratch dir. The binary: the one
  named by ``BATCHRL_BWRAP`` (a copied Debian binary, e.g. the GPU bundle's; a ``<binary>.sha256`` beside it is
  checked), else ``bwrap`` on PATH.
- ``namespaces`` (boundary, where bubblewrap cannot be had): ``unshare`` user, PID, network, mount, IPC and UTS
  namespaces; inside, as the namespace's root, a private tmpfs over the storage root, the Dagster home, $HOME, /tmp
  and /dev (a few devices bound back), the rest of the tree read-only, then every capability dropped.
- ``rlimits`` (not a boundary): no namespaces; the host's files, processes and network stay reachable except where
  Landlock and seccomp refuse them (plus an audit hook in the interpreter). Tool rollouts refuse it unless the config
  says ``allow_weak_sandbox: true``.

At every level the second walls go on inside where the machine has them (``inside.py``): Landlock (read the system
and the interpreter, write only the scratch dir, no TCP, no signals out), the seccomp filter
(``seccomp_filter.py``), no-new-privileges, rlimits (address space, CPU, file size, open files, processes), a
scratch working directory, a cleared environment.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil

from batchrl.common.environment_variables import read

LEVELS = ("bwrap", "namespaces", "rlimits")
BOUNDARIES = ("bwrap", "namespaces")
WHY_WEAK = {"rlimits": "no namespaces: the host's files, processes and network are reachable except where Landlock "
                       "and seccomp refuse them"}


def bwrap_binary() -> tuple[str | None, str]:
    """The bubblewrap binary to use and how it was found (or why none is usable)."""
    configured = read("BATCHRL_BWRAP")
    if not configured:
        found = shutil.which("bwrap")
        return (found, "on PATH") if found else (None, "no bwrap on PATH and BATCHRL_BWRAP unset")
    if not os.access(configured, os.X_OK):
        return None, f"BATCHRL_BWRAP={configured} is not an executable file"
    expected_file = configured + ".sha256"
    if not os.path.exists(expected_file):
        return configured, "BATCHRL_BWRAP (no .sha256 beside it: not checked)"
    with open(expected_file) as f:
        expected = f.read().split()[0]
    with open(configured, "rb") as f:
        actual = hashlib.sha256(f.read()).hexdigest()
    if actual != expected:
        return None, f"BATCHRL_BWRAP={configured}: sha256 {actual} differs from {expected_file}'s {expected}"
    return configured, f"BATCHRL_BWRAP, sha256 {actual[:16]}... checked"


def landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 without Landlock."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    abi = libc.syscall(444, None, 0, 1)  # landlock_create_ruleset(NULL, 0, LANDLOCK_CREATE_RULESET_VERSION)
    return max(int(abi), 0)


def is_boundary(level: str) -> bool:
    return level in BOUNDARIES


def weak_level_refusal(level: str, allowed: bool, where: str) -> str | None:
    """The one line refusing to run model code at ``level`` (None when it is a boundary or ``allowed``)."""
    if is_boundary(level) or allowed:
        return None
    return (f"{where}: the sandbox here is {level!r}, not a boundary ({WHY_WEAK.get(level, level)}); install "
            "bubblewrap (or allow user namespaces), or set allow_weak_sandbox: true to run model code anyway")
