"""Rollout engines: ``make_rollout_engine("transformers" | "vllm", model_path=..., ...)``.

vLLM is imported only when its engine is built (GPU hosts with the ``gpu`` extra).
"""
from __future__ import annotations

from typing import Any, Callable

from batchrl.training.rollout.base import RolloutEngine, make_sample
from batchrl.training.rollout.transformers_engine import TransformersRolloutEngine
from batchrl.training.rollout.vllm_engine import VLLMRolloutEngine, VLLMUnavailableError

ROLLOUT_ENGINES: dict[str, Callable[..., RolloutEngine]] = {
    "transformers": TransformersRolloutEngine,
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
    "ROLLOUT_ENGINES", "RolloutEngine", "TransformersRolloutEngine", "VLLMRolloutEngine",
    "VLLMUnavailableError", "make_rollout_engine", "make_sample",
]
