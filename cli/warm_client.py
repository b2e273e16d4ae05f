"""The thin client of ``batchrl serve`` (``warm_server``) and what a server is keyed by: standard library only, so
``batchrl``'s start stays ~0.1 s when a warm server runs its command.

``run_remote`` passes a command's arguments, working dir, environment and its stdin/stdout/stderr (the
descriptors themselves, over the server's Unix socket) to the server of its environment, forwards Ctrl-C and
termination to the forked child, and returns the child's exit status; None when no server answers (the command
then runs in its own process). A server serves one combination of interpreter, batchrl's code (its files' sizes
and times: an edited checkout gets its own server, never a stale one), installed packages (``installed_stamp``),
working dir and the variables read when modules are imported (``KEYED_PREFIXES``).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import sys
import tempfile

from batchrl.common.environment_variables import read
from batchrl.common.package import PACKAGE_DIR, code_fingerprint

# variables read when modules are imported or a process starts (libraries' settings, paths): a server imported
# its modules under one combination of them, so it serves commands with the same; the rest of a command's
# environment (credentials, terminal) reaches its child as is
KEYED_PREFIXES = ("BATCHRL_", "DAGSTER_", "PYTHON", "CUDA_", "HF_", "TRANSFORMERS_", "TORCH", "OMP_", "MKL_",
                  "NCCL_", "TOKENIZERS_", "VLLM_", "TRITON_", "LD_", "PATH", "VIRTUAL_ENV", "LANG", "LC_", "TZ")
OFF_ENV = "BATCHRL_SERVER"
STREAMS = 3  # stdin, stdout, stderr


def installed_stamp(folders: list[str] | None = None) -> list:
    """The site-packages folders and their mtimes: installing, upgrading or removing a package renames or adds
    entries there (the dist-info's name carries the version), so a server that imported the old Dagster or torch
    no longer matches."""
    import site

    folders = folders if folders is not None else sorted({*site.getsitepackages(), site.getusersitepackages()})
    stamps = []
    for folder in folders:
        with contextlib.suppress(OSError):
            stamps.append((folder, os.stat(folder).st_mtime_ns))
    return stamps


def server_key(env: dict[str, str], cwd: str) -> str:
    keyed = {k: v for k, v in env.items() if k.startswith(KEYED_PREFIXES) and k != OFF_ENV}
    return hashlib.sha256(json.dumps([sys.executable, PACKAGE_DIR, code_fingerprint(PACKAGE_DIR), installed_stamp(),
                                      os.path.realpath(cwd), keyed], sort_keys=True).encode()).hexdigest()[:16]


def socket_path(env: dict[str, str], cwd: str) -> str:
    """A short path (Unix sockets allow ~100 bytes) under the temp dir, one per ``server_key``."""
    folder = os.path.join(tempfile.gettempdir(), f"batchrl-server-{os.getuid()}")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    return os.path.join(folder, server_key(env, cwd) + ".sock")


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _connect(path: str) -> socket.socket | None:
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        client.connect(path)
    except (FileNotFoundError, ConnectionRefusedError):
        client.close()
        return None
    return client


def run_remote(argv: list[str]) -> int | None:
    """Run the command ``argv`` in the warm server of this environment; its exit status, or None when no
    server answers (or ``BATCHRL_SERVER=off``): the caller runs the command itself."""
    if not read(OFF_ENV) or (argv[:1] == ["serve"]):
        return None
    cwd = os.getcwd()
    client = _connect(socket_path(dict(os.environ), cwd))
    if client is None:
        return None
    with client, client.makefile("rb") as answers:
        request = json.dumps({"argv": argv, "argv0": sys.argv[0], "cwd": cwd, "env": dict(os.environ)}).encode() \
            + b"\n"  # argv0: how the user called batchrl, which the run's footer repeats
        socket.send_fds(client, [request], [fd if _is_open(fd) else os.open(os.devnull, os.O_RDWR)
                                            for fd in range(STREAMS)])  # a closed stream: the child's is /dev/null
        first = answers.readline()
        if not first.startswith(b"pid "):  # a server going away between connect and fork: run it here
            return None
        child = int(first.split()[1])

        def forward(signum, _frame):
            try:
                os.kill(child, signum)
            except ProcessLookupError:
                pass

        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, forward)
        last = answers.readline()
        if not last.startswith(b"exit "):
            print(f"batchrl: the warm server's process {child} for this command ended without an exit status",
                  file=sys.stderr)
            return 1
        return int(last.split()[1])


def stop(env: dict[str, str], cwd: str) -> bool:
    """Ask this environment's server to exit; False when none answers."""
    client = _connect(socket_path(env, cwd))
    if client is None:
        return False
    with client, client.makefile("rb") as answers:
        client.sendall(json.dumps({"stop": True}).encode() + b"\n")
        answers.readline()
    return True


def ping(env: dict[str, str], cwd: str) -> dict | None:
    client = _connect(socket_path(env, cwd))
    if client is None:
        return None
    with client, client.makefile("rb") as answers:
        client.sendall(json.dumps({"ping": True}).encode() + b"\n")
        line = answers.readline()
    return json.loads(line) if line else None
