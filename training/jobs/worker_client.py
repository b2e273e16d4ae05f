"""Finding, starting and asking a long-lived job worker (``training/jobs/worker.py``) over its Unix socket, without
Dagster: the Dagster side's ``resources/job_worker.py`` builds on it, and so does a Ray rank on its node
(``resources/ray_rank.py``), where batchrl runs without a Dagster process.

A worker is found by a socket path keyed by the interpreter, the code's version and the environment that matters
to a job; when none answers, one is started (a file lock keeps two callers from starting two).
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Iterator

from batchrl.common.package import code_fingerprint  # an edited batchrl gets a worker of its own

START_TIMEOUT_S = 120
# variables that change what a job computes or where: a worker serves one combination of them
KEYED_ENV = ("PYTHONPATH", "CUDA_VISIBLE_DEVICES", "BATCHRL_ENV", "BATCHRL_STORAGE", "BATCHRL_NUM_GPUS",
             "BATCHRL_WEIGHT_CACHE_GB")
PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class WorkerUnavailable(RuntimeError):
    """No worker answered on the socket, and the one started for it did not come up in time."""


def socket_path(env: dict[str, str]) -> str:
    """A short path (Unix sockets allow ~100 bytes) under the temp dir, one per interpreter + environment +
    version of the code."""
    key = json.dumps([sys.executable, PACKAGE, code_fingerprint(PACKAGE),
                      {k: env.get(k) for k in KEYED_ENV}], sort_keys=True)
    folder = os.path.join(tempfile.gettempdir(), f"batchrl-workers-{os.getuid()}")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    return os.path.join(folder, hashlib.sha256(key.encode()).hexdigest()[:16] + ".sock")


def named_worker_path(env: dict[str, str], name: str) -> str:
    """The socket of a worker of its own for one kind of work (``name``: the off-policy rollouts', a Ray rank's)."""
    return socket_path(env).removesuffix(".sock") + f"-{name}.sock"


def worker_log(path: str) -> str:
    return path.removesuffix(".sock") + ".log"


def _connect(path: str) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        return sock
    except (FileNotFoundError, ConnectionRefusedError):
        sock.close()
        return None


# started through a short-lived parent, so that the worker is nobody's child: Ray may kill an actor's children
# with it (the node-worker case of tests/test_ray_cluster.py finds the workers alive after their actors ended)
_DETACH = ("import subprocess, sys; subprocess.Popen(sys.argv[1:], stdin=subprocess.DEVNULL, start_new_session=True)")


def _start_worker(path: str, env: dict[str, str], idle_s: float, orphan: bool) -> None:
    command = [sys.executable, "-m", "batchrl.training.jobs.worker", "--socket", path, "--idle", str(idle_s)]
    with open(worker_log(path), "ab") as log:  # the jobs' own output, as a subprocess's would be
        if orphan:
            subprocess.run([sys.executable, "-c", _DETACH, *command], env=env, stdin=subprocess.DEVNULL, stdout=log,
                           stderr=subprocess.STDOUT, check=True)
        else:  # outlives the caller's step (a session of its own): the next one finds it warm
            subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)


def connect_or_start(path: str, env: dict[str, str], idle_s: float, orphan: bool = False) -> socket.socket:
    """A connection to the worker of ``path``, started with ``env`` if none answers (``orphan``: re-parented at
    once, so that it outlives a caller whose children are killed with it)."""
    sock = _connect(path)
    if sock is not None:
        return sock
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        sock = _connect(path)
        if sock is None:
            _start_worker(path, env, idle_s, orphan)
            deadline = time.monotonic() + START_TIMEOUT_S
            while sock is None and time.monotonic() < deadline:
                time.sleep(0.05)
                sock = _connect(path)
    if sock is None:
        raise WorkerUnavailable(f"the job worker did not start within {START_TIMEOUT_S} s; see {worker_log(path)}")
    return sock


def stream_job(path: str, payload: dict, env: dict[str, str], idle_s: float, orphan: bool = True
               ) -> Iterator[tuple[str, object]]:
    """Run one job in the worker of ``path`` with its output streamed back: yields ``("out", line)`` and
    ``("err", line)`` as the job prints them, then ``("answer", {...})`` (``ok``, ``pid``, ``job_s`` or the error).
    The worker abandons the job (and exits) if this connection closes before the answer."""
    sock = connect_or_start(path, env, idle_s, orphan)
    with sock, sock.makefile("rwb") as stream:
        stream.write(json.dumps({**payload, "stream": True}).encode() + b"\n")
        stream.flush()
        for raw in stream:
            message = json.loads(raw)
            if "out" in message:
                yield "out", message["out"]
            elif "err" in message:
                yield "err", message["err"]
            else:
                yield "answer", message
                return
    yield "answer", {"ok": False, "error": f"the job worker exited during the job (killed? out of memory?); its "
                                          f"output: {worker_log(path)}"}
