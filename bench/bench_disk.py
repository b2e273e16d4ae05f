"""Hygiene for the device benches (``bench_gpu_rl_vs_trl.py``): what a bench will not read again, removed, and an
arm's job workers stopped before the next arm needs the GPU."""
from __future__ import annotations

import contextlib
import os

# The device has 64 GiB of disk: a six-minute arm publishes ~47 checkpoints (0.54 GB each at 135M in fp32, 1.6 GB with
# the carried optimiser state). The bench, not batchrl, removes what it will not read again: every published file
# stays linked from the arm's work dirs until then, so these deletions free the space (both links go).

def prune_checkpoints(storage: str, keep: set) -> float:
    """After an arm: the policy checkpoints other than ``keep`` (the final policy, the curve points) deleted with
    their work dirs' links. Returns the GB freed."""
    import shutil

    before = shutil.disk_usage(storage).free
    shutil.rmtree(os.path.join(storage, "_cache", "_work", "policy_checkpoint"), ignore_errors=True)
    root = os.path.join(storage, "policy_checkpoint")
    kept = {os.path.basename(str(uri).rstrip("/")) for uri in keep if uri}
    for name in os.listdir(root) if os.path.isdir(root) else []:
        if name not in kept:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return round((shutil.disk_usage(storage).free - before) / 1e9, 1)


class OptimizerStatePruner:
    """While an arm runs: the carried optimiser states of all but the newest ``KEEP`` checkpoints deleted (each is
    read once, by the next update), every ``EVERY_S`` seconds. Those checkpoints' files then differ from their data
    version: the bench never audits them."""
    KEEP, EVERY_S = 2, 5.0

    def __init__(self, storage: str):
        import threading

        self.storage, self.stop = storage, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import glob

        while not self.stop.wait(self.EVERY_S):
            states = {}  # a checkpoint's state folders (its storage link, its work dir's), by the first shard's inode
            for folder in glob.glob(os.path.join(self.storage, "**", "optimizer"), recursive=True):
                shards = sorted(glob.glob(os.path.join(folder, "state-*.safetensors")))
                with contextlib.suppress(FileNotFoundError):
                    if shards:
                        states.setdefault(os.stat(shards[0]).st_ino, []).append((os.path.getmtime(shards[0]), shards))
            by_age = sorted(states.values(), key=lambda links: max(mtime for mtime, _ in links))
            for links in by_age[:-self.KEEP]:
                for path in (path for _, shards in links for path in shards):
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(path)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def stop_job_workers(storage: str, wait_s: float = 15.0) -> int:
    """The job workers of the arm whose storage root is ``storage`` stopped: a warm worker keeps the GPU memory of
    its last job for ``worker_idle_s``, and the next arm (TRL's trainer and vLLM in one process) needs it on an
    80 GB card (the first ``trl_vllm`` try after ``full`` died of CUDA OOM on the H100, 2026-12-06). A worker is
    known by its module in its command line and the arm's root in its environment. Returns how many were stopped."""
    import signal
    import time

    mark = f"BATCHRL_STORAGE={storage}".encode()
    stopped = []
    for pid in (name for name in os.listdir("/proc") if name.isdigit()):
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read().split(b"\0")
            if b"batchrl.training.jobs.worker" in argv and mark in environ:
                os.kill(int(pid), signal.SIGTERM)
                stopped.append(int(pid))

    def running(pid: int) -> bool:  # a zombie (a child of this process, not reaped) has exited
        with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        return False

    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(running(pid) for pid in stopped):
        time.sleep(0.2)
    for pid in stopped:  # one that outlived SIGTERM
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return len(stopped)
