"""Dagster's side of the long-lived job worker (``batchrl.training.jobs.worker``).

``run_in_worker`` opens a Pipes session (temp-file context and messages, as ``PipesSubprocessClient``
uses), hands the job and the session's bootstrap variables to the worker over its Unix socket, and
returns the completed invocation: the asset sees the same Pipes logs and materialisation as from a
subprocess. The worker is found by a socket path keyed by the interpreter and the environment that
matters to a job; when none answers, one is started (a file lock keeps two steps from starting two).
One job runs at a time per worker. ``slots`` (the launcher's ``gpu_job_slots``) bounds the jobs on this host:
each holds a slot (``free_slot``, a file lock) and runs in that slot's worker, or in processes of its own;
with more than one, steps that Dagster runs side by side (a multiprocess run) share the GPU instead of queueing.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from typing import Any

import dagster as dg

from batchrl.common.environment_variables import PREFIX as JOB_SETTING_PREFIX  # per-job settings: sent per request
from batchrl.resources.pipes_messages import DrainingTempFileMessageReader
from batchrl.training.jobs import worker_client
from batchrl.training.jobs.worker_client import named_worker_path, socket_path, worker_log  # noqa: F401  (API)


def slot_path(env: dict[str, str], slot: int) -> str:
    """The socket of GPU job slot ``slot`` (``TrainerLauncherResource.gpu_job_slots``): slot 0 is
    ``socket_path``'s, each further slot a worker of its own."""
    path = socket_path(env)
    return path if slot == 0 else path.removesuffix(".sock") + f"-{slot}.sock"


def run_detached(job: str, config_path: str, workdir: str, env: dict[str, str], idle_s: float, path: str) -> int:
    """Hand ``job`` to the worker of ``path`` and return once it is accepted (its pid), not when it ends: the job
    runs without Pipes (its outputs are its files) and the worker's next request waits behind it."""
    answer = request(path, {"job": job, "config": config_path, "cwd": workdir, "detached": True,
                            "env": job_request_env(env)}, env, idle_s)
    return int(answer["pid"])


@contextlib.contextmanager
def free_slot(env: dict[str, str], slots: int):
    """The socket of a worker among ``slots`` that runs no job now (slot 0 first), held for the caller's
    job (which may also run in processes of its own, the slot only counting it); waits while all are busy."""
    while True:
        for slot in range(slots):
            path = slot_path(env, slot)
            busy = open(path + ".busy", "w")
            try:
                fcntl.flock(busy, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                busy.close()
                continue
            try:
                yield path
            finally:
                busy.close()  # releases the lock: the next step's job may take this worker
            return
        time.sleep(0.1)


def connect_or_start(path: str, env: dict[str, str], idle_s: float) -> socket.socket:
    """``worker_client.connect_or_start`` with its failure as the step's."""
    try:
        return worker_client.connect_or_start(path, env, idle_s)
    except worker_client.WorkerUnavailable as error:
        raise dg.Failure(str(error)) from error


def prestart(env: dict[str, str], idle_s: float, slots: int = 1) -> None:
    """Have the workers of ``slots`` for ``env`` starting now, without waiting for their imports (each preloads
    torch and the CUDA context while the run's first, data-only steps execute); running ones are left as they are."""
    for slot in range(slots):
        connect_or_start(slot_path(env, slot), env, idle_s).close()  # an empty request: the worker just goes on


def request(path: str, payload: dict[str, Any], env: dict[str, str], idle_s: float) -> dict[str, Any]:
    """Send one request line and wait for the answer line (a job may run for hours: no timeout)."""
    with contextlib.closing(connect_or_start(path, env, idle_s)) as sock, sock.makefile("rwb") as stream:
        stream.write(json.dumps(payload).encode() + b"\n")
        stream.flush()
        line = stream.readline()
    if not line:
        raise dg.Failure(f"the job worker exited during job {payload.get('job')!r} (killed? out of memory?); "
                         f"its output: {worker_log(path)}", metadata={"worker_log": _tail(worker_log(path))})
    return json.loads(line)


def _tail(path: str, n: int = 4000) -> str:
    with contextlib.suppress(OSError), open(path, "rb") as f:
        f.seek(max(0, os.path.getsize(path) - n))
        return f.read().decode(errors="replace")
    return ""


def job_request_env(env: dict[str, str]) -> dict[str, str]:
    """The variables a job request carries: what the job sets on top of this process's environment, and every
    ``BATCHRL_`` setting (the worker may have been started by another run's step with other settings: a job sees
    exactly the ``BATCHRL_`` variables of the step that asked for it, ``training.jobs.worker._job_environment``)."""
    return {k: v for k, v in env.items() if os.environ.get(k) != v or k.startswith(JOB_SETTING_PREFIX)}


def run_in_worker(context: dg.AssetExecutionContext, job: str, config_path: str, workdir: str,
                  env: dict[str, str], idle_s: float, path: str) -> dg.PipesClientCompletedInvocation:
    """Run ``job`` in the warm worker of socket ``path`` (a slot ``free_slot`` holds for it) and return Pipes'
    completed invocation."""
    with dg.open_pipes_session(
            context=context, context_injector=dg.PipesTempFileContextInjector(),
            message_reader=DrainingTempFileMessageReader()) as session:
        asked = time.perf_counter()
        answer = request(path, {"job": job, "config": config_path, "cwd": workdir,
                                "env": {**job_request_env(env), **session.get_bootstrap_env_vars()}}, env, idle_s)
        if not answer.get("ok"):
            raise dg.Failure(f"job {job!r} failed in the job worker (pid {answer.get('pid')}): {answer.get('error')}",
                             metadata={"traceback": answer.get("traceback", "")})
    # the request's wall beside the job's: the rest is the wait for the worker (still collecting the last job's
    # garbage?) and the socket round trip
    context.log.info(f"job {job} ran in the warm worker pid {answer['pid']} in {answer['job_s']:.3f} s "
                     f"(request {time.perf_counter() - asked:.3f} s)")
    return dg.PipesClientCompletedInvocation(session, metadata={"worker_pid": answer["pid"]})
