"""Hygiene for the device benches (``bench_gpu_rl_vs_trl.py``): what a bench will not read again, removed, and an
arm's job workers stopped before the next arm needs the GPU."""
from __future__ import annotations

import contextlib
import os

# The device has 64 GiB of disk: a six-minute arm publishes ~47 checkpoints (0.54 GB each at 135M in fp32), an
# eight-minute GSM8K arm ~19 of 2 GB (0.5B). An arm keeps every checkpoint (its curve points are picked after it) and
# batchrl's retention expires the carried optimiser states as it runs; after the arm the bench removes the checkpoints
# it will not read again: every published file stays linked from the arm's work dirs until then, so these deletions
# free the space (both links go).

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


def share_converted_base(state: str, arm: str) -> list[str]:
    """Before ``arm``'s first run: another arm's joined and converted base GGUF (``_cache/gguf-parts``,
    ``_cache/gguf``) hard-linked into this arm's empty cache, where base_model then finds it. The join and conversion
    run once a sitting instead of once an arm (at 1.5B the base_model step took 83 s on an H100; 8.2 GB each).
    Returns what was linked."""
    from batchrl.common.fsutil import link_tree

    mine = os.path.join(state, arm, "storage", "_cache")
    for other in sorted(os.listdir(state)):
        theirs = os.path.join(state, other, "storage", "_cache")
        if other == arm or not os.path.isdir(os.path.join(theirs, "gguf")):
            continue
        folders = [f for f in ("gguf-parts", "gguf") if os.path.isdir(os.path.join(theirs, f))
                   and not os.path.exists(os.path.join(mine, f))]  # never over files already there
        for folder in folders:
            link_tree(os.path.join(theirs, folder), os.path.join(mine, folder))
        return [os.path.join(other, folder) for folder in folders]
    return []
