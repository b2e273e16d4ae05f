"""Rollout engines: ``make_rollout_engine("transformers" | "static" | "vllm", model_path=..., ...)``.

``transformers``: plain HF ``generate`` (any causal LM, the CPU default); ``static``: Llama-family models
on a static KV cache with CUDA-graph decode steps (the fast GPU path without vLLM); ``vllm``: vLLM.

vLLM is imported only when its engine is built (GPU hosts with the ``gpu`` extra).
"""
from __future__ import annotations

from typing import Any, Callable

from batchrl.training.rollout.base import RolloutEngine, make_sample
from batchrl.training.rollout.static_engine import StaticCacheRolloutEngine
from batchrl.training.rollout.transformers_engine import TransformersRolloutEngine
from batchrl.training.rollout.vllm_engine import VLLMRolloutEngine, VLLMUnavailableError

ROLLOUT_ENGINES: dict[str, Callable[..., RolloutEngine]] = {
    "transformers": TransformersRolloutEngine,
    "static": StaticCacheRolloutEngine,
    "vllm": VLLMRolloutEngine,
}


def make_rollout_engine(kind: str, **kwargs: Any) -> RolloutEngine:
    """Build the engine registered under ``kind`` with ``kwargs`` (``model_path`` first among them)."""
    try:
        factory = ROLLOUT_ENGINES[kind]
    except KeyError:
        raise ValueError(f"unknown rollout engine {kind!r}; known: {sorted(ROLLOUT_ENGINES)}") from None
    return factory(**kwargs)


__all__ = [
    "ROLLOUT_ENGINES", "RolloutEngine", "StaticCacheRolloutEngine", "TransformersRolloutEngine", "VLLMRolloutEngine",
    "VLLMUnavailableError", "make_rollout_engine", "make_sample",
]
