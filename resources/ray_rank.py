"""One rank of a Ray job (an actor placed by Ray in a placement-group bundle): stages the job's inputs from the
storage root onto its node, runs the same job entry point as everywhere (``python -m batchrl.training.jobs.<job>``)
with the rendezvous variables the driver hands it, streams the job's output lines back to the driver, and
uploads what the job wrote (``resources/ray_staging.py``).

The job runs as a child process, not inside the actor: a data-parallel rank ends with ``os._exit``
(``training/jobs/_runtime.py``), and its torch/DeepSpeed state must not outlive the job. The child dies with the
actor (``PR_SET_PDEATHSIG``), so a rank killed by Ray or lost with its node leaves no process behind.
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
from batchrl.resources import ray_staging

STDERR_TAIL_LINES = 40
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
        self.spec, self.rank = spec, rank
        self.fs, self.prefix = fsutil.filesystem_for(spec["prefix"], storage_options)
        self.scratch = tempfile.mkdtemp(prefix=f"batchrl-ray-{spec['job']}-rank{rank}-")
        self.local = {root: os.path.join(self.scratch, str(i), os.path.basename(root) or "root")
                      for i, root in enumerate(spec["roots"])}
        self.found: dict = {}

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
        """Stage the inputs, run the job; yields its stdout lines, then ``{"exit": code, "stderr_tail": [...]}``."""
        config_path = self._stage()
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

    @staticmethod
    def _echo_stderr(stream, tail: collections.deque) -> None:
        for line in stream:  # to the actor's log (Ray shows it in the job's log) and kept for a failure message
            sys.stderr.write(line)
            tail.append(line.rstrip("\n"))

    def _stage(self) -> str:
        for i, root in enumerate(self.spec["roots"]):
            if ray_staging.download(self.fs, fsutil.join(self.prefix, "in", str(i)), self.local[root]) == 0:
                os.makedirs(os.path.dirname(self.local[root]), exist_ok=True)  # a file the job writes
        self.found = ray_staging.snapshot(list(self.local.values()))
        config = ray_staging.rewrite_paths(self.spec["configs"][self.rank % len(self.spec["configs"])], self.local)
        path = os.path.join(self.scratch, f"{self.spec['job']}.json")
        with open(path, "w") as f:
            json.dump(config, f)
        return path

    def publish(self) -> int:
        """Upload what the job created or changed under every root; the number of files."""
        count = 0
        for i, root in enumerate(self.spec["roots"]):
            changed = ray_staging.changed_files(self.local[root], self.found)
            ray_staging.upload(self.fs, fsutil.join(self.prefix, "out", str(i)), changed)
            count += len(changed)
        return count

    def close(self) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)
