"""A bounded, process-wide cache of loaded model weights, on the device they were loaded to.

Why: the GPU jobs (reference log-probs, rollouts, evaluation, reward scoring, the trainers) run one after
another in the long-lived job worker (``training/jobs/worker.py``), and every job loaded its models from
their HF folders again, although the same base model folder is loaded by several jobs of a run (and by the
next run's jobs: an unchanged base model keeps its folder and files). On one H200 with a Qwen2-0.5B-shaped
model (~1 GB of bf16 weights, 151,936-token vocabulary, tied embeddings) that load was 0.43 s of a 2.6 s
reference log-probs step (1.68 s of GPU work) and 0.72 s of evaluation: idle GPU seconds. A hit builds the
model on the device without reading any file and copies the cached tensors into its own parameters (device to
device). Measured on the H200 at that shape (494M parameters, 0.99 GB file in the page cache, transformers 5.17):
a load 0.27 s from the files, 0.025 s from the cache (building the empty model 17 ms, the copy 5-8 ms); keeping
the copy on a miss adds nothing measurable; logits, buffers and config bit-identical.

What is kept: per entry, a clone of the loaded model's state-dict tensors (each storage once: tied
embeddings are one tensor), a clone of its non-persistent buffers (rotary ``inv_freq``: restored as the
normal load computed them, so a hit gives bit-identical outputs) and opaque extras (the caller's config
objects). Never aliased: a hit copies into the new model's own storage, and a miss stores a clone, so jobs
that train or overwrite their model in place (evaluation copies the next checkpoint in) leave the cache
as it was.

Key (``key``): each weight file's identity (real path, size, ``st_mtime_ns``, ``st_ctime_ns``, inode) plus the identity of
the folder's other files that shape the model (``config.json``, ``generation_config.json``), the dtype,
the device and the kind of model. A rewritten or replaced file (another mtime, ctime, size or inode) is a miss.

Bounds: least-recently-used entries are evicted to stay within ``limit_bytes()``; an entry larger than the
limit is not kept. Disabled by default (limit 0: nothing is stored, nothing is looked up): only the job
worker calls ``enable`` (at startup), because the Dagster process must never hold GPU memory between assets.
The worker's limit, ``worker_limit_bytes``: ``BATCHRL_WEIGHT_CACHE_GB`` (decimal GB; 0 disables) when set,
else 4 GB on a CUDA host but at most 10% of the device's memory, and 0 (off) on a host without CUDA. On a
CUDA host the worker keeps models loaded onto the GPU only: a load onto the CPU (the trainers' float32 one)
gains little (CPU, 116M-parameter model: bf16 file to bf16 0.043 s from the files, which transformers maps
without a copy, vs 0.064 s from the cache; to float32 0.14 vs 0.11 s) and host memory must not take the GPU's
budget.

Pure torch + stdlib: the transformers-specific building of a model lives with the loader
(``tiny_model.load_model_and_tokenizer``), which hands its steps to ``load``.
"""
from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, TypeVar

import torch

from batchrl.common.environment_variables import read

ENV = "BATCHRL_WEIGHT_CACHE_GB"
DEFAULT_BYTES = 4 * 10**9
MAX_DEVICE_FRACTION = 0.10

M = TypeVar("M", bound=torch.nn.Module)


@dataclass
class Entry:
    tensors: dict[str, torch.Tensor]  # state-dict name -> clone, one per storage (a tied weight under one name)
    # non-persistent buffers (not in the state dict) -> clone; None: weights only (``training/models/resident_weights.py``), copied
    # into a model that keeps its own buffers, cast to its dtype
    buffers: dict[str, torch.Tensor] | None
    extras: dict[str, Any] = field(default_factory=dict)  # the caller's, e.g. the loaded model's config
    nbytes: int = 0


_lock = threading.RLock()
_entries: OrderedDict[Hashable, Entry] = OrderedDict()
_limit = 0
_host = True  # whether loads onto the CPU are cached too
_rejected: set[Hashable] = set()  # keys whose entry did not fit the built model: not stored again
_counts = {"hits": 0, "misses": 0, "stores": 0, "evictions": 0, "not_kept": 0, "fallbacks": 0}


def enable(limit_bytes: int, *, host: bool = True) -> None:
    """Keep up to ``limit_bytes`` of weights from now on (0 disables and empties the cache); ``host``: models
    loaded onto the CPU too (else only those on an accelerator)."""
    global _limit, _host
    with _lock:
        _limit, _host = max(0, int(limit_bytes)), host
        _evict_to(_limit)


def disable() -> None:
    enable(0)


def enabled() -> bool:
    return _limit > 0


def limit_bytes() -> int:
    return _limit


def clear() -> None:
    """Drop every entry (the limit stays), forget rejected keys, zero the counters."""
    with _lock:
        _entries.clear()
        _rejected.clear()
        _counts.update(dict.fromkeys(_counts, 0))


def resident_limit_bytes(env_var: str, device_fraction: float) -> int:
    """What a model kept resident in the worker (an engine, a trainer) may hold: ``env_var`` (decimal GB; 0: never
    kept) when set, else ``device_fraction`` of the GPU's memory, else, on a host without CUDA, this cache's limit."""
    gigabytes = read(env_var)
    if gigabytes is not None:
        return int(gigabytes * 10**9)
    if torch.cuda.is_available():
        return int(device_fraction * torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    return limit_bytes()


def worker_limit_bytes(env: dict[str, str] | None = None) -> int:
    """The job worker's limit: ``BATCHRL_WEIGHT_CACHE_GB`` when set (decimal GB, 0 disables), else 4 GB on a
    CUDA host but never more than 10% of the device's memory, else 0 (a CPU-only host: off)."""
    gigabytes = read(ENV, env)
    if gigabytes is not None:
        return int(gigabytes * 10**9)
    if not torch.cuda.is_available():
        return 0
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return int(min(DEFAULT_BYTES, MAX_DEVICE_FRACTION * total))


def enable_for_worker() -> int:
    """The job worker's setting, at its startup: ``worker_limit_bytes()``; on a CUDA host only models loaded onto
    the GPU are kept (a host-side load, as the trainers' float32 one onto the CPU, costs about what a copy from
    the cache would, and host memory must not take the GPU's budget). Returns the limit."""
    enable(worker_limit_bytes(), host=not torch.cuda.is_available())
    return _limit


def stats() -> dict[str, int]:
    """Counters since the process started or ``clear`` (hits, misses, stores, evictions, not_kept: too large or
    not plain tensors, fallbacks: an entry that did not fit its model) and the cache now (entries, bytes,
    limit_bytes)."""
    with _lock:
        return {**_counts, "entries": len(_entries), "bytes": sum(e.nbytes for e in _entries.values()),
                "limit_bytes": _limit}


def _file_identity(path: str) -> tuple:
    st = os.stat(path)
    # ctime too: a file deleted and replaced by another of the same size, with its mtime copied over
    # (``cp -p``, ``shutil.copy2``) on a reused inode number, has a new ctime, which nothing can set back
    return os.path.realpath(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino


def canonical_device(device: str | torch.device) -> torch.device:
    """``cuda`` and ``cuda:0`` (the current device) are one device."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def key(weight_files: list[str], *, dtype: torch.dtype, device: str | torch.device, kind: str = "",
        other_files: tuple[str, ...] = ()) -> tuple | None:
    """The cache key of a model loaded from ``weight_files`` as ``dtype`` on ``device``; ``other_files`` (those
    that exist) count too. None (not cacheable): without weight files, when one cannot be read, on the CPU
    when host models are not cached."""
    device = canonical_device(device)
    if not weight_files or (device.type == "cpu" and not _host):
        return None
    try:
        weights = tuple(_file_identity(f) for f in weight_files)
        others = tuple(_file_identity(f) for f in other_files if os.path.exists(f))
    except OSError:
        return None
    return kind, weights, others, str(dtype), str(device)


def _evict_to(limit: int) -> None:
    total = sum(e.nbytes for e in _entries.values())
    while _entries and total > limit:
        _, old = _entries.popitem(last=False)
        total -= old.nbytes
        _counts["evictions"] += 1


@torch.no_grad()
def snapshot(model: torch.nn.Module, extras: dict[str, Any] | None = None,
             max_bytes: int | None = None, *, clone: bool = True) -> Entry | None:
    """A clone of ``model``'s weights: its state-dict tensors (a storage shared by several names, as tied
    embeddings, cloned once under the first name) and its non-persistent buffers. None when the state dict
    holds something else than plain tensors (extra state, meta or distributed tensors), or when the weights
    take more than ``max_bytes`` (checked before anything is cloned)."""
    state = model.state_dict()
    unique: dict[str, torch.Tensor] = {}
    seen: set[tuple] = set()
    for name, value in state.items():
        if type(value) is not torch.Tensor or value.is_meta:
            return None
        ident = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape),
                 tuple(value.stride()), value.dtype)
        if ident not in seen:
            seen.add(ident)
            unique[name] = value
    buffers = {name: b for name, b in model.named_buffers() if name not in state}
    if any(type(b) is not torch.Tensor or b.is_meta for b in buffers.values()):
        return None
    nbytes = sum(t.nbytes for t in unique.values()) + sum(b.nbytes for b in buffers.values())
    if max_bytes is not None and nbytes > max_bytes:
        return None
    if not clone:  # weights only, the model's own tensors (a finished job's, never written again)
        return Entry({name: t.detach() for name, t in unique.items()}, None, dict(extras or {}),
                     sum(t.nbytes for t in unique.values()))
    copied = lambda tensors: {name: t.detach().clone() for name, t in tensors.items()}  # noqa: E731
    return Entry(copied(unique), copied(buffers), dict(extras or {}), nbytes)


def put(cache_key: Hashable, entry: Entry) -> bool:
    """Keep ``entry`` under ``cache_key`` (the newest), evicting the least recently used to fit; an entry larger
    than the limit is not kept. Returns whether it was kept."""
    with _lock:
        if not enabled() or cache_key in _rejected:
            return False
        _entries.pop(cache_key, None)
        if entry.nbytes > _limit:
            _counts["not_kept"] += 1
            return False
        _evict_to(_limit - entry.nbytes)
        _entries[cache_key] = entry
        _counts["stores"] += 1
        return True


def get(cache_key: Hashable) -> Entry | None:
    """The entry of ``cache_key`` (now the most recently used), or None."""
    with _lock:
        entry = _entries.get(cache_key) if enabled() else None
        if entry is not None:
            _entries.move_to_end(cache_key)
        return entry


def reject(cache_key: Hashable) -> None:
    """Drop ``cache_key``'s entry and keep none for it again (its entry does not fit the model built for it)."""
    with _lock:
        _entries.pop(cache_key, None)
        _rejected.add(cache_key)
        _counts["fallbacks"] += 1


def forget(cache_key: Hashable) -> None:
    """Drop ``cache_key``'s entry, if any (its tensors are about to change: a kept trainer's weights); a later load
    may store it again."""
    with _lock:
        _entries.pop(cache_key, None)


@torch.no_grad()
def restore(model: torch.nn.Module, entry: Entry,
            copy_state: Callable[[torch.nn.Module, dict[str, torch.Tensor]], bool]) -> bool:
    """Copy ``entry`` into ``model``'s own parameters and buffers. ``copy_state(model, tensors)`` copies the
    state-dict tensors and returns False, the model untouched, when they do not cover the model (names,
    shapes, tied weights: ``weights.load_weights_in_place``). False too when a dtype or device differs (a
    module the loader keeps in float32, say) or the non-persistent buffers differ in name, shape or dtype.
    A weights-only entry (``buffers`` None) is copied across dtypes (``copy_`` rounds as a load from the files
    does) and leaves the model's buffers as they are."""
    state = model.state_dict()
    for name, value in entry.tensors.items():
        mine = state.get(name)
        if mine is None or mine.shape != value.shape:
            return False
        if entry.buffers is not None and (mine.dtype != value.dtype or mine.device != value.device):
            return False
    if entry.buffers is None:  # weights only: cast into the model's dtype, its buffers its own
        return copy_state(model, entry.tensors)
    buffers = {name: b for name, b in model.named_buffers() if name not in state}
    if buffers.keys() != entry.buffers.keys() or any(
            b.shape != entry.buffers[n].shape or b.dtype != entry.buffers[n].dtype for n, b in buffers.items()):
        return False
    if not copy_state(model, entry.tensors):
        return False
    for name, b in buffers.items():
        b.copy_(entry.buffers[name])
    return True


def load(cache_key: Hashable | None, *, build: Callable[[Entry], M], load: Callable[[], M],
         copy_state: Callable[[M, dict[str, torch.Tensor]], bool],
         extras: Callable[[M], dict[str, Any]] | None = None,
         keep_if: Callable[[M], bool] | None = None) -> tuple[M, bool]:
    """``(model, hit)``. A hit: ``build(entry)`` (an empty model on the device, from ``entry.extras``) with the
    cached weights restored into it. Otherwise ``load()``, and a snapshot of it kept (with ``extras(model)``)
    when the cache is on and ``keep_if(model)`` holds: a load not worth keeping (a head its files lack,
    initialised at random) is decided on before anything is stored, so it evicts no other entry (at the 7B
    shape a reward model loaded from the base's folder evicted the policy's base each iteration: 2.5 s of
    reloading, ``bench/RESULTS.md``). An entry that does not fit the built model is dropped for good and the
    load runs."""
    entry = get(cache_key) if cache_key is not None else None
    if entry is not None:
        model = build(entry)
        if restore(model, entry, copy_state):
            with _lock:
                _counts["hits"] += 1
            return model, True
        del model
        reject(cache_key)
    model = load()
    if cache_key is not None and enabled():
        with _lock:
            _counts["misses"] += 1
        if keep_if is not None and not keep_if(model):
            with _lock:
                _counts["not_kept"] += 1
        elif cache_key not in _rejected:
            kept = snapshot(model, extras(model) if extras else None, max_bytes=_limit)
            if kept is not None:
                put(cache_key, kept)
            else:
                with _lock:
                    _counts["not_kept"] += 1  # too large, or not plain tensors
    return model, False


def load_into(cache_key: Hashable | None, model: torch.nn.Module,
              copy_state: Callable[[torch.nn.Module, dict[str, torch.Tensor]], bool]) -> bool:
    """Copy ``cache_key``'s cached weights into an existing ``model`` (device to device; a hit), e.g. an engine
    whose CUDA graphs stay valid while checkpoints of its model are copied in. False (nothing copied, not
    counted) when nothing is cached for it or the entry does not fit."""
    entry = get(cache_key) if cache_key is not None else None
    if entry is None or not restore(model, entry, copy_state):
        return False
    with _lock:
        _counts["hits"] += 1
    return True


def keep(cache_key: Hashable | None, model: torch.nn.Module, extras: dict[str, Any] | None = None) -> bool:
    """Keep a snapshot of ``model``, which now holds ``cache_key``'s weights (loaded into it some other way: a
    miss), for later loads of them. Returns whether it was kept."""
    if cache_key is None or not enabled() or cache_key in _rejected:
        return False
    with _lock:
        _counts["misses"] += 1
    kept = snapshot(model, extras, max_bytes=_limit)
    return kept is not None and put(cache_key, kept)

