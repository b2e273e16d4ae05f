"""One rank of a Ray job (an actor placed by Ray in a placement-group bundle): stages the job's inputs from the
storage root onto its node, runs the same job entry point as everywhere (``python -m batchrl.training.jobs.<job>``)
with the rendezvous variables the driver hands it, streams the job's output lines back to the driver, and
uploads what the job wrote (``resources/ray_staging.py``).

A data-parallel rank runs as a child process, not inside the actor: it ends with ``os._exit``
(``training/jobs/_runtime.py``), and its torch/DeepSpeed state must not outlive the job. The child dies with the
actor (``PR_SET_PDEATHSIG``), so a rank killed by Ray or lost with its node leaves no process behind. A
one-process job (one rank, a rollout replica) runs in the node's resident job worker instead, as jobs on one
machine run in the warm worker: the worker outlives the actor (that is its point), but not the actor's job.
"""
from __future__ import annotations

import collections
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from typing import Iterator

from batchrl.common import fsutil
from batchrl.resources import ray_inputs, ray_staging

STDERR_TAIL_LINES = 40
OUTPUT_RECORD = "output.json"  # in the scratch: the job's hashed output (BATCHRL_OUTPUT_RECORD, training/jobs/_runtime)
PIPES_ENV_PREFIX = "DAGSTER_PIPES_"  # a job's own Pipes session: never a resident worker's for good
# the job's process: SIGKILLed when the actor's process ends (PR_SET_PDEATHSIG = 1; set by the child itself, as a
# preexec_fn would run Python between fork and exec in a process full of Ray's threads), gone at once if the actor
# already is, then the job module run as `python -m` runs it
CHILD = ("import ctypes, os, runpy, signal, sys; ctypes.CDLL('libc.so.6').prctl(1, signal.SIGKILL); "
         "os.getppid() == int(sys.argv[1]) or os._exit(1); module = sys.argv[2]; sys.argv = [module, *sys.argv[3:]]; "
         "runpy.run_module(module, run_name='__main__', alter_sys=True)")


def _with(base, changes: dict[str, str | None]) -> dict[str, str]:
    """``base`` with ``changes`` applied (None: removed)."""
    return {k: v for k, v in {**base, **changes}.items() if v is not None}


class JobRank:
    """The actor class (wrapped with ``ray.remote`` by the driver, which owns placement and resources)."""

    def __init__(self, spec: dict, storage_options: dict, rank: int):
        self.storage_options = storage_options
        self.take_job(spec, rank)

    def take_job(self, spec: dict, rank: int) -> None:
        """This actor's next job, with a scratch and state of its own (the resident driver keeps a gang of rank
        actors between jobs of the same shape: ``resources/ray_gangs.py``)."""
        self.spec, self.rank = spec, rank
        self.fs, self.prefix = fsutil.filesystem_for(spec["prefix"], self.storage_options)
        self.scratch = tempfile.mkdtemp(prefix=f"batchrl-ray-{spec['job']}-rank{rank}-")
        self.local = {root: os.path.join(self.scratch, str(i), os.path.basename(root) or "root")
                      for i, root in enumerate(spec["roots"])}
        self.found: dict = {}
        self.artifacts = {int(i): remote for i, remote in spec.get("artifacts", {}).items()}
        self.inputs = ray_inputs.NodeInputCache()

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0's node address and a free port on it: the process group's ``MASTER_ADDR``/``MASTER_PORT``."""
        import ray

        address = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((address, 0))
            return address, s.getsockname()[1]

    def node(self) -> str:
        import ray

        return f"{ray.util.get_node_ip_address()} (node {ray.get_runtime_context().get_node_id()[:12]})"

    def run(self, env: dict[str, str | None]) -> Iterator[str | dict]:
        """Stage the inputs, run the job; yields its stdout lines, then ``{"exit": code, "stderr_tail": [...]}``.
        A one-process job (no ``WORLD_SIZE``: one rank, or a replica) runs in its node's resident job worker when
        the spec keeps one (``resident_idle_s``); a data-parallel rank always in a process of its own."""
        config_path = self._stage()
        env = {**env, "BATCHRL_OUTPUT_RECORD": os.path.join(self.scratch, OUTPUT_RECORD)}
        if self.spec.get("resident_idle_s", 0) > 0 and not env.get("WORLD_SIZE"):
            yield from self._run_resident(config_path, _with(os.environ, env))
            return
        module = f"batchrl.training.jobs.{self.spec['job']}"
        proc = subprocess.Popen([sys.executable, "-c", CHILD, str(os.getpid()), module, config_path],
                                cwd=self.scratch, text=True, env=_with(os.environ, env), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
        tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        echo = threading.Thread(target=self._echo_stderr, args=(proc.stderr, tail), daemon=True)
        echo.start()
        for line in proc.stdout:
            yield line.rstrip("\n")
        code = proc.wait()
        echo.join(timeout=10)
        if code != 0:  # nothing of a failed job is uploaded: its scratch goes now (a killed actor leaves it)
            self.close()
        yield {"exit": code, "stderr_tail": list(tail)}

    def _run_resident(self, config_path: str, env: dict[str, str]) -> Iterator[str | dict]:
        """The job in this node's resident worker for this rank slot (``training/jobs/worker.py``; started here
        if none answers, re-parented so that it outlives this actor, gone after ``resident_idle_s`` idle): the
        imports, the CUDA context and the model classes are paid once per node, not per job. The job gets this
        actor's whole environment (its Pipes context included) for its duration; the worker is started without
        the Pipes variables, and abandons the job if this actor dies."""
        import ray

        from batchrl.training.jobs import worker_client

        name = f"ray-{ray.get_runtime_context().get_node_id()[:12]}-{self.rank}"
        path = worker_client.named_worker_path(env, name)
        start_env = {k: v for k, v in env.items() if not k.startswith(PIPES_ENV_PREFIX)}
        tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        answer: dict = {}
        try:
            for kind, item in worker_client.stream_job(path, {"job": self.spec["job"], "config": config_path,
                                                              "cwd": self.scratch, "env": env},
                                                       start_env, self.spec["resident_idle_s"]):
                if kind == "out":
                    yield item
                elif kind == "err":
                    sys.stderr.write(item + "\n")
                    tail.append(item)
                else:
                    answer = item
        except (worker_client.WorkerUnavailable, OSError, subprocess.SubprocessError) as error:
            answer = {"ok": False, "error": f"{type(error).__name__}: {error}"}
        if not answer.get("ok"):
            tail.append(f"in the resident job worker ({worker_client.worker_log(path)}): {answer.get('error')}")
            self.close()
        yield {"exit": 0 if answer.get("ok") else 1, "stderr_tail": list(tail), "worker_pid": answer.get("pid"),
               "job_s": answer.get("job_s")}

    @staticmethod
    def _echo_stderr(stream, tail: collections.deque) -> None:
        for line in stream:  # to the actor's log (Ray shows it in the job's log) and kept for a failure message
            sys.stderr.write(line)
            tail.append(line.rstrip("\n"))

    def _stage(self) -> str:
        for i, root in enumerate(self.spec["roots"]):
            if i in self.artifacts:  # a published artifact: this node's copy, fetched by the first job that read it
                self.local[root] = self.inputs.local(self.fs, self.artifacts[i])
            elif ray_staging.download(self.fs, fsutil.join(self.prefix, "in", str(i)), self.local[root]) == 0:
                os.makedirs(os.path.dirname(self.local[root]), exist_ok=True)  # a file the job writes
        self.found = ray_staging.snapshot(self._written_roots())
        config = ray_staging.rewrite_paths(self.spec["configs"][self.rank % len(self.spec["configs"])], self.local)
        config = ray_staging.resolve_node_cache(config, self.inputs.node_folder())
        path = os.path.join(self.scratch, f"{self.spec['job']}.json")
        with open(path, "w") as f:
            json.dump(config, f)
        return path

    def publish(self) -> int:
        """Upload what the job created or changed under every root; the number of files."""
        count = 0
        for i, root in enumerate(self.spec["roots"]):
            if i in self.artifacts:
                continue
            changed = ray_staging.changed_files(self.local[root], self.found)
            ray_staging.upload(self.fs, fsutil.join(self.prefix, "out", str(i)), changed)
            count += len(changed)
        record = os.path.join(self.scratch, OUTPUT_RECORD)
        if os.path.exists(record):  # the output the job hashed: kept here for the later jobs that read it published
            with open(record) as f:
                output = json.load(f)
            self.inputs.keep_produced(output["dir"], output["content_hash"])
        return count

    def _written_roots(self) -> list[str]:
        """The local roots a job may write into: all but the published artifacts it reads."""
        return [self.local[root] for i, root in enumerate(self.spec["roots"]) if i not in self.artifacts]

    def inputs_read(self) -> dict[str, int]:
        """Published artifacts this rank read: from its node's cache, built from an output a job on this node
        wrote, or fetched into it."""
        return {"cached": self.inputs.reused, "produced": self.inputs.produced, "fetched": self.inputs.fetched}

    def close(self) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)
