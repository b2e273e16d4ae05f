"""The rollout engine stays in the job worker from one rollouts job to the next, the new policy's weights copied in.

Every RL iteration samples from a new checkpoint of the same model: same architecture, config and tokenizer, other
weights. A new engine per iteration loaded the checkpoint from its files and, for the static-cache engine, captured
its CUDA graphs again (engine load ~0.2-0.3 s of a ~3 s rollouts step on the H200 with SmolLM2-135M, the captures
inside generation besides). The worker keeps the last engine instead; the next job of the same engine settings on a
folder of the same model (``weights.same_model_files``) copies the weights in place
(``tiny_model.load_checkpoint_in_place``: from the trainer's weights still on the device, ``training/models/resident_weights.py``,
else the weight cache, else the files), and the captured graphs stay valid (they replay on the same storage).

Kept only where the worker's weight cache is on (never in the Dagster process), for the engines that hold a
transformers model (``static``, ``transformers``) when the engine's tensors (its weights and static KV caches) fit
``limit_bytes``: the engine holds that memory while the other jobs run (SmolLM2-135M at 512 rows x 160 slots: ~2 GB;
a 7B shape's bf16 weights alone: ~15 GB). A vLLM engine is kept only with ``sleep_mode`` (the rollout resource's
``vllm_resident``; otherwise it runs in a fresh process per job): it sleeps between jobs (``suspend``: its memory
given back) and takes a new checkpoint through its own loader (``load_checkpoint``); a kept engine that is
replaced or released is shut down (vLLM's engine-core process and memory pool go with it).
"""
from __future__ import annotations

import threading
from typing import Any

import torch

from batchrl.training.models import weight_cache

RESIDENT_KINDS = ("static", "transformers")
ENV = "BATCHRL_RESIDENT_ENGINE_GB"
DEVICE_FRACTION = 0.25

_lock = threading.Lock()
_kept: tuple[dict, Any] | None = None  # (the engine's options, the engine)


def engine_bytes(engine: Any) -> int:
    """The engine's weights plus its static decoders' caches (what it holds between jobs)."""
    total = sum(p.nbytes for p in engine.model.parameters())
    for decoder in getattr(engine, "_decoders", {}).values():
        total += sum(t.nbytes for t in vars(decoder).values() if isinstance(t, torch.Tensor))
    return total


def limit_bytes() -> int:
    """What a kept engine may hold: ``BATCHRL_RESIDENT_ENGINE_GB``, else a quarter of the GPU's memory (the trainers
    keep the rest), else the weight cache's limit (``weight_cache.resident_limit_bytes``)."""
    return weight_cache.resident_limit_bytes(ENV, DEVICE_FRACTION)


def resident_kind(options: dict[str, Any]) -> bool:
    """Whether an engine of ``options`` may stay in the worker: the transformers engines, vLLM with ``sleep_mode``."""
    return options["kind"] in RESIDENT_KINDS or (options["kind"] == "vllm" and bool(options.get("sleep_mode")))


def _reusable(kept: dict, options: dict) -> bool:
    from batchrl.training.models.weights import same_model_files

    same_settings = {k: v for k, v in kept.items() if k != "model_path"} == \
        {k: v for k, v in options.items() if k != "model_path"}
    return same_settings and same_model_files(kept["model_path"], options["model_path"])


def _reusable_kept(options: dict[str, Any]) -> Any | None:
    """The kept engine when ``options`` may take it over (same settings, same model but for its weights), else None."""
    with _lock:
        kept = _kept
    return kept[1] if kept is not None and _reusable(kept[0], options) else None


def _new_engine(options: dict[str, Any]) -> Any:
    """A new engine for ``options``; the kept one's memory goes first (another model or settings)."""
    from batchrl.training.rollout import make_rollout_engine

    release()
    return make_rollout_engine(options["kind"], **{k: v for k, v in options.items() if k != "kind"})


def engine_for(options: dict[str, Any]) -> tuple[Any, bool]:
    """``(engine, reused)`` for ``make_rollout_engine(**options)`` (``kind`` among them): the kept engine with
    ``options["model_path"]``'s weights copied in when it can be, else a new one."""
    from batchrl.training.rollout import make_rollout_engine
    from batchrl.training.models.loading import load_checkpoint_in_place

    options = dict(options)
    if not resident_kind(options) or not weight_cache.enabled():
        kind = options.pop("kind")
        return make_rollout_engine(kind, **options), False
    kept = _reusable_kept(options)
    if kept is not None and (kept.load_checkpoint(options["model_path"]) if hasattr(kept, "load_checkpoint") else
                             load_checkpoint_in_place(kept.model, options["model_path"],
                                                      dtype=options.get("dtype", "float32"),
                                                      device=options.get("device", "cpu"))):
        return kept, True
    return _new_engine(options), False


def engine_with_weights(options: dict[str, Any], tensors: dict[str, torch.Tensor]) -> tuple[Any, bool] | None:
    """``(engine, reused)`` for ``options`` with ``tensors`` (a trainer's state dict: another checkpoint of
    ``options["model_path"]``'s model) copied in, cast as a load of their export would cast them: the kept engine
    when it can be, else a new one built from ``options["model_path"]``. None when the weights do not fit it."""
    from batchrl.training.models.weights import load_weights_in_place

    kept = _reusable_kept(options)
    engine = kept if kept is not None else _new_engine(options)
    with torch.no_grad():
        return (engine, kept is not None) if load_weights_in_place(engine.model, options["model_path"], tensors) \
            else None


def keep(options: dict[str, Any], engine: Any) -> bool:
    """After a job: keep ``engine`` for the next when it is of a resident kind and fits the weight cache's limit."""
    global _kept
    if not resident_kind(options) or not weight_cache.enabled():
        return False
    if hasattr(engine, "suspend"):  # its memory is given back while it sleeps: no size limit to check
        engine.suspend()
    elif engine_bytes(engine) > limit_bytes():
        return False
    with _lock:
        replaced, _kept = _kept, (dict(options), engine)
    if replaced is not None and replaced[1] is not engine:
        _shut_down(replaced[1])
    return True


def release() -> None:
    """Drop the kept engine (its memory is freed with the next collection; a vLLM engine is shut down now)."""
    global _kept
    with _lock:
        replaced, _kept = _kept, None
    if replaced is not None:
        _shut_down(replaced[1])


def _shut_down(engine: Any) -> None:
    shutdown = getattr(engine, "shutdown", None)
    if shutdown is not None:
        shutdown()
