"""The policy stays resident in the job worker: the weights a trainer job just exported are kept, by the content of
the artifact they are published as, for the next job that copies them into a model it holds (issue 32).

In an RL iteration the policy update exports its weights and the next iteration's rollouts load that very export
into the rollout engine (``training/rollout/resident.py`` keeps the engine: its model and captured CUDA graphs).
Both jobs run one after the other in the same worker process, so the trainer's weights are still on the device
when the rollouts job asks for the checkpoint: they are copied device to device (cast to the engine's dtype, as a
load from the files casts) instead of read from the files the trainer has just written. The export, its hash and
the published artifact are unchanged (every checkpoint is an immutable artifact; a crash loses nothing published).

How the two jobs agree on what is kept: the trainer ``offer``s its exported folder's weights (not copied: the job
is over and its model is never written again); the job's runtime, having hashed that folder, ``settle``s them
under its content hash, which the published artifact carries as its data version (``lineage.json``); a load of
a folder whose ``lineage.json`` names that data version finds them (``key_of``). Entries live in the weight cache
(``training/models/weight_cache.py``): its limit and LRU bound them, and nothing is kept where the cache is off (the
Dagster process, a CPU host unless ``BATCHRL_WEIGHT_CACHE_GB`` is set). Pure torch + stdlib.
"""
from __future__ import annotations

import json
import os
import threading

import torch

from batchrl.training.models import weight_cache

LINEAGE_FILE = "lineage.json"  # a published artifact's record, data_version included (resources/storage.py)

_lock = threading.Lock()
_offered: dict[str, weight_cache.Entry] = {}  # real path of an exported folder -> its weights, until settled


def artifact_key(data_version: str) -> tuple:
    return ("artifact", data_version)


def offer(folder: str, model: torch.nn.Module) -> bool:
    """The trainer exported ``model``'s weights to ``folder``: keep them (weights only) until the job's content
    hash of the folder ``settle``s them. False when the cache is off or they do not fit it."""
    if not weight_cache.enabled():
        return False
    entry = weight_cache.snapshot(model, max_bytes=weight_cache.limit_bytes(), clone=False)
    if entry is None:
        return False
    with _lock:
        _offered[os.path.realpath(folder)] = entry
    return True


def settle(output: str | None, content_hash: str | None) -> bool:
    """The job's output folder was hashed to ``content_hash``: its offered weights are kept under that content
    (the data version is its first 16 hex digits, ``StorageResource.publish``); whatever else was offered and
    not output is dropped. Returns whether weights were kept."""
    with _lock:
        entry = _offered.pop(os.path.realpath(output), None) if output else None
        _offered.clear()
    return bool(entry is not None and content_hash and weight_cache.put(artifact_key(content_hash[:16]), entry))


def data_version_of(path: str) -> str | None:
    """The data version the published artifact at ``path`` records (``lineage.json``), None when it is none."""
    try:
        with open(os.path.join(path, LINEAGE_FILE)) as f:
            return str(json.load(f).get("data_version") or "") or None
    except (OSError, ValueError, AttributeError):
        return None


def key_of(path: str) -> tuple | None:
    """The cache key of the weights of the published artifact at ``path`` when the cache holds them, else None
    (not an artifact, or weights not kept)."""
    if not weight_cache.enabled() or (data_version := data_version_of(path)) is None:
        return None
    key = artifact_key(data_version)
    return key if weight_cache.get(key) is not None else None
