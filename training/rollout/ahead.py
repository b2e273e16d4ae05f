"""On-policy sampling ahead: the policy update samples the next iteration's rollouts from the weights it has just
trained while it exports, hashes and publishes them (issue 32, "the checkpoint of iteration k is exported, hashed
and published while iteration k+1 already samples"; verl's hybrid engine keeps the trainer's weights for the
rollouts the same way).

The next iteration samples, by definition, the promoted policy — the one this update is about to publish — with the
seed ``batchrl run --rl-iterations N`` announces for it (a run tag; nothing is sampled ahead without one) and a
prompt subset drawn from it: a function of this job's weights and of config. So the update's job, after its last
optimiser step, copies its weights into the job worker's rollout engine (``resident.engine_with_weights``: device to
device, cast as a load of the export casts) and samples that request on a thread, while the main thread writes the
export and hashes it (a LoRA update: once its adapter, megabytes, is exported, the engine's base with the adapter
merged, as a load of the published adapter). Once hashed, the samples' folder is named by the request the next
rollouts step will make (``common/prefetch_key.py``: the policy's data version is in it), the samples and then their
statistics are written there, and the step takes them — the same samples it would have drawn itself, so the same
data version; the lineage is unchanged (the rollouts' input is the published checkpoint). Every checkpoint is still
published before anything samples from it in the asset graph: a crash at any point loses no published iteration and
leaves at worst a folder without statistics, which the next rollouts job ignores and samples itself.

The worker waits for a sampling ahead to finish before it starts its next job (``wait``): the engine and the
global RNG state the sampling forks are this thread's until then. Pure torch + stdlib.
"""
from __future__ import annotations

import json
import os
import threading
import time
import traceback
from typing import Any

from batchrl.common.prefetch_key import AHEAD_MARK, SAMPLES_FILE, STATS_FILE, request_folder


class _Pending:
    """One sampling ahead: its thread, and the folder its samples go to once the policy is hashed."""

    def __init__(self, request: dict[str, Any]):
        self.request = request
        self.folder: str | None = None
        self.settled = threading.Event()
        self.thread: threading.Thread | None = None


_pending: _Pending | None = None


def start(request: dict[str, Any], *, module: Any = None, adapter: str | None = None,
          base: str | None = None) -> dict[str, Any]:
    """Sample ``request`` (``{"engine": rollout engine options on the policy the update started from, "prompts",
    "messages", "n", "seed", "agent", "root", "key_parts"}``) on a thread, from ``module``'s weights (after the
    update's last step, before its export) or from the exported LoRA ``adapter`` merged into its ``base`` (as a
    load of the published adapter merges it). Returns the job's metadata about it."""
    global _pending
    from batchrl.training.models import weight_cache
    from batchrl.training.rollout import resident

    wait()
    started = time.perf_counter()
    options = dict(request["engine"])
    if module is not None:
        entry = weight_cache.snapshot(module, clone=False)  # the trained weights as they are (never written again)
        built = None if entry is None else resident.engine_with_weights(options, entry.tensors)
    else:
        from batchrl.training.models import lora

        if not lora.merges_in_place(adapter):
            return {"sample_ahead": "off: the adapter replaces modules (modules_to_save, DoRA)"}
        options["model_path"] = base  # the engine holds the base's model; its weights: the base's, the adapter merged
        built = resident.engine_for(options)
        lora.merge_in_place(built[0].model, adapter)
    if built is None:
        return {"sample_ahead": "off: the trained weights do not fit the rollout engine's model"}
    _synchronize(options.get("device", "cpu"))  # the copy is complete before the export reads on
    pending = _Pending({**request, "engine": options})
    pending.thread = threading.Thread(target=_sample, args=(pending, (*built, time.perf_counter() - started)),
                                      name="batchrl-sample-ahead", daemon=True)
    _pending = pending
    pending.thread.start()
    return {"sample_ahead": "started", "sample_ahead_seed": request["seed"],
            "sample_ahead_copy_s": round(time.perf_counter() - started, 3)}


def settle(content_hash: str | None) -> dict[str, Any]:
    """The job hashed its export (``content_hash``; None: the job failed first): the samples go to the folder of the
    next rollouts' request on this policy (created here, marked as filled ahead), or are dropped."""
    pending = _pending
    if pending is None or pending.settled.is_set():
        return {}
    if content_hash:
        folder = request_folder(pending.request["root"], pending.request["key_parts"], content_hash[:16])
        os.makedirs(folder, exist_ok=True)
        for name in (STATS_FILE, SAMPLES_FILE):  # a folder of an earlier attempt at the same request
            if os.path.exists(os.path.join(folder, name)):
                os.remove(os.path.join(folder, name))
        with open(os.path.join(folder, AHEAD_MARK), "w") as f:
            json.dump({"pid": os.getpid()}, f)
        pending.folder = folder
    pending.settled.set()
    return {"sample_ahead_folder": pending.folder} if pending.folder else {}


def wait() -> None:
    """Until the sampling ahead under way (if any) has written its samples or given up."""
    pending = _pending
    if pending is not None and pending.thread is not None:
        pending.thread.join()


def _sample(pending: _Pending, built: tuple) -> None:
    from batchrl.training.rollout.sampling_job import write_stats
    from batchrl.training.rollout.sampling_job import sample_to_parquet

    request = pending.request
    scratch = os.path.join(request["root"], f".ahead-{os.getpid()}")
    os.makedirs(scratch, exist_ok=True)
    try:
        started = time.perf_counter()
        with _side_stream(request["engine"].get("device", "cpu")):
            stats = sample_to_parquet(request["engine"], request["prompts"], n=request["n"], seed=request["seed"],
                                      out_parquet=os.path.join(scratch, SAMPLES_FILE), messages=request["messages"],
                                      agent=request["agent"], built=built)
        stats.update(sampled_ahead=True, sample_ahead_s=round(time.perf_counter() - started, 3))
        pending.settled.wait()
        if pending.folder is not None:  # the samples first, then the statistics that mark them complete
            os.replace(os.path.join(scratch, SAMPLES_FILE), os.path.join(pending.folder, SAMPLES_FILE))
            write_stats(os.path.join(pending.folder, STATS_FILE), stats)
    except BaseException:  # the next rollouts job samples itself; the worker's log says why
        print(f"sampling ahead failed (the next rollouts will sample themselves):\n{traceback.format_exc()}",
              flush=True)
    finally:
        if os.path.exists(os.path.join(scratch, SAMPLES_FILE)):
            os.remove(os.path.join(scratch, SAMPLES_FILE))


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _side_stream(device: str):
    """On a GPU the thread samples on a stream of its own, so the export's copies off the device do not queue
    behind its kernels on the default stream."""
    import contextlib

    if not device.startswith("cuda"):
        return contextlib.nullcontext()
    import torch

    return torch.cuda.stream(torch.cuda.Stream(device=device))
