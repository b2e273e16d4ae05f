"""A long-lived job worker: runs batchrl's one-process jobs one after another in the same process.

A job started as a fresh subprocess pays the interpreter, the imports (torch, transformers, deepspeed),
the CUDA context and the process group before its first useful kernel — on one H200 that was 18-30 s of
an idle GPU per stage (bench/RESULTS.md). The worker pays them once: it listens on a Unix socket, and
for each request (one JSON line: job name, config path, working dir, the Dagster Pipes bootstrap
variables) it runs the job's ``work`` in process through the same ``run_job`` plumbing as the
subprocess entry point, so the job reports to Dagster through Pipes exactly as before, then answers
one JSON line (``{"ok": true, "pid": ...}`` or the error); a ``stream`` request (a Ray rank's,
``training/jobs/worker_client.stream_job``) gets the job's output lines first, as they are printed. It exits
after ``--idle`` seconds without a request, and after a failed job (a fresh process for the next one: a
failure may leave CUDA or the process group in a bad state).

    python -m batchrl.training.jobs.worker --socket /path/worker.sock [--idle 600]
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import io
import json
import os
import select
import socket
import sys
import threading
import time
import traceback

from batchrl.common.environment_variables import PREFIX as JOB_SETTING_PREFIX  # a request carries every one
from batchrl.common.environment_variables import read

PROTOCOL = 1


def _release_memory() -> None:
    """Between jobs: the job's garbage collected and torch's unused cached blocks given back. The weight cache
    (``training/models/weight_cache.py``) stays: its tensors are in use, not free blocks."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextlib.contextmanager
def _job_environment(env: dict[str, str], cwd: str):
    """The request's variables (Pipes bootstrap, per-job settings) and working dir, for this job only. The
    request holds all of its step's ``BATCHRL_`` settings: one of this process's that it lacks (left by the
    run that started the worker) is unset for the job."""
    stale = [key for key in os.environ if key.startswith(JOB_SETTING_PREFIX) and key not in env]
    saved_env = {key: os.environ.get(key) for key in [*env, *stale]}
    for key in stale:
        del os.environ[key]
    saved_cwd = os.getcwd()
    os.environ.update(env)
    os.chdir(cwd)
    try:
        yield
    finally:
        # open_dagster_pipes keeps one context per process; the next job opens its own
        from dagster_pipes import PipesContext

        PipesContext._instance = None
        os.chdir(saved_cwd)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _profiled(job: str):
    """``BATCHRL_CPROFILE_DIR`` (a diagnostic, bench/profile_rl_plumbing.py): the job's Python time under cProfile,
    dumped to ``<dir>/<job>-<pid>-<n>.prof`` — where a step's seconds outside its GPU work go in the worker."""
    folder = read("BATCHRL_CPROFILE_DIR")
    if not folder:
        yield
        return
    import cProfile

    os.makedirs(folder, exist_ok=True)
    profile = cProfile.Profile()
    profile.enable()
    try:
        yield
    finally:
        profile.disable()
        count = len([n for n in os.listdir(folder) if n.startswith(f"{job}-{os.getpid()}-")])
        profile.dump_stats(os.path.join(folder, f"{job}-{os.getpid()}-{count}.prof"))


def run_request(request: dict) -> dict:
    """Run one job request in this process; the answer says whether it succeeded."""
    from batchrl.training.jobs import JOBS, TRAINING_JOBS
    from batchrl.training.jobs._runtime import run_job

    job = request["job"]
    if job not in JOBS:
        return {"ok": False, "error": f"unknown job {job!r}; expected one of {JOBS}"}
    ahead = sys.modules.get("batchrl.training.rollout.ahead")
    if ahead is not None:  # the last update's sampling of the next iteration: its engine and RNG until it is done
        ahead.wait()
    started = time.perf_counter()
    try:
        with _job_environment(request.get("env", {}), request.get("cwd", os.getcwd())):
            if job in TRAINING_JOBS and read("BATCHRL_NUM_GPUS") > 1:
                raise ValueError("data-parallel jobs run under torchrun, not in the worker")
            module = importlib.import_module(f"batchrl.training.jobs.{job}")
            with _profiled(job):
                run_job(module.work, [request["config"]])
        return {"ok": True, "pid": os.getpid(), "job_s": time.perf_counter() - started}
    except BaseException as error:  # reported to the client; the worker then exits
        return {"ok": False, "pid": os.getpid(), "error": f"{type(error).__name__}: {error}",
                "traceback": traceback.format_exc()[-6000:]}


class _LinesOut(io.TextIOBase):
    """A job's stdout or stderr sent back over the request's connection as JSON lines (``{"out": line}``,
    ``{"err": line}``): the requester relays them (a Ray rank: to its driver, where the Pipes messages are read)."""

    def __init__(self, stream, key: str, lock: threading.RLock):
        self.stream, self.key, self.lock, self.pending = stream, key, lock, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        with self.lock:  # the job's threads print too
            self.pending += text
            *lines, self.pending = self.pending.split("\n")
            for line in lines:
                self._send(line)
        return len(text)

    def flush(self) -> None:
        with self.lock:
            if self.pending:
                self._send(self.pending)
                self.pending = ""

    def _send(self, line: str) -> None:
        try:
            with self.lock:
                self.stream.write(json.dumps({self.key: line}).encode() + b"\n")
                self.stream.flush()
        except OSError:  # the requester is gone: nobody takes this job's results
            os._exit(1)


def _exit_when_requester_leaves(conn: socket.socket, done: threading.Event) -> None:
    """While a streamed job runs: the requester closing its end (a Ray actor killed or lost) abandons the job, and
    the worker with it, as a job process dies with its actor."""
    while not done.wait(0.5):
        readable, _, _ = select.select([conn], [], [], 0)
        if readable and not conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT):
            os._exit(1)


def _run_streamed(request: dict, conn: socket.socket, stream) -> dict:
    """``run_request`` with the job's output lines streamed to the requester as it prints them."""
    lock, done = threading.RLock(), threading.Event()  # one lock: stdout's and stderr's lines never interleave
    out, err = _LinesOut(stream, "out", lock), _LinesOut(stream, "err", lock)
    threading.Thread(target=_exit_when_requester_leaves, args=(conn, done), daemon=True).start()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            answer = run_request(request)
            out.flush()
            err.flush()
    finally:
        done.set()
    if not answer["ok"]:
        for line in answer.get("traceback", "").splitlines():
            err._send(line)
    return answer


# What the jobs import lazily (transformers' auto classes alone take seconds): loaded by ``preload``
PRELOAD_MODULES = (
    "batchrl.training.jobs._runtime", "batchrl.training.rollout.static_engine", "batchrl.training.evaluation.evaluate",
    "batchrl.training.rewards.registry", "batchrl.training.rewards.reward_model", "batchrl.training.trainer.reference",
    "batchrl.training.trainer.dpo", "batchrl.training.trainer.policy", "batchrl.training.trainer.reward",
    "peft",  # LoRA runs and adapter checkpoints (training/models/lora.py)
    "transformers.models.auto.modeling_auto", "transformers.models.auto.tokenization_auto",
    "transformers.models.qwen2.modeling_qwen2", "transformers.models.llama.modeling_llama",
)


def preload() -> None:
    """What every job needs first (torch, transformers' model classes, DeepSpeed, batchrl's job libraries,
    the CUDA context, the weight cache switched on), loaded once the socket listens: a client connecting
    meanwhile waits in the backlog, and a worker started ahead of the first job
    (``resources.job_worker.prestart``) has it ready by the time the job comes."""
    import torch

    for name in PRELOAD_MODULES:
        with contextlib.suppress(ImportError):  # a model family this transformers lacks: loaded on use
            importlib.import_module(name)
    with contextlib.suppress(ImportError):
        from batchrl.training.trainer.engine import import_deepspeed

        import_deepspeed()
    if torch.cuda.is_available():
        torch.zeros(1, device="cuda")  # creates the context
    from batchrl.training.models import weight_cache

    weight_cache.enable_for_worker()  # jobs of this process reuse the models loaded before (BATCHRL_WEIGHT_CACHE_GB)


def serve(socket_path: str, idle_s: float) -> int:
    if os.path.exists(socket_path):
        os.unlink(socket_path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(socket_path)
    server.listen(16)
    preload()
    gc.freeze()  # the preloaded modules' objects: never garbage, so the collection after each job skips them
    server.settimeout(idle_s)
    try:
        while True:
            try:
                conn, _ = server.accept()
            except TimeoutError:
                return 0  # idle: give the memory back
            with conn, conn.makefile("rwb") as stream:
                line = stream.readline()
                if not line:
                    continue
                request = json.loads(line)
                if request.get("detached"):  # answered at once, run after: its outputs are its files
                    stream.write(json.dumps({"ok": True, "pid": os.getpid(), "detached": True}).encode() + b"\n")
                    stream.flush()
                if request.get("ping"):
                    answer = {"ok": True, "pid": os.getpid(), "protocol": PROTOCOL}
                elif request.get("stream"):
                    answer = _run_streamed(request, conn, stream)
                else:
                    answer = run_request(request)
                if not request.get("detached"):
                    stream.write(json.dumps(answer).encode() + b"\n")
                    stream.flush()
                elif not answer["ok"]:  # nobody waits for this answer: the worker's log keeps it
                    print(f"detached job {request['job']!r} failed: {answer.get('error')}\n"
                          f"{answer.get('traceback', '')}", file=sys.stderr, flush=True)
            if not request.get("ping"):
                # after the answer: the step goes on while this process collects the job's garbage (a full
                # collection over torch's and transformers' objects, which every step waited for before)
                _release_memory()
            if not answer["ok"]:
                return 1
    finally:
        server.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(socket_path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--socket", required=True)
    parser.add_argument("--idle", type=float, default=600.0, help="seconds without a request before exiting")
    args = parser.parse_args(argv)
    return serve(args.socket, args.idle)


if __name__ == "__main__":
    sys.exit(main())
