"""Rollout engine resource: transformers on CPU (default) or vLLM on GPU hosts, chosen by config."""
from __future__ import annotations

import dagster as dg


class RolloutEngineResource(dg.ConfigurableResource):
    kind: str = "transformers"  # "transformers" | "vllm"
    max_new_tokens: int = 12
    temperature: float = 1.0
    top_p: float = 1.0
    batch_size: int = 64
    device: str = "cpu"
    dtype: str = "float32"

    def engine(self, model_path: str):
        from batchrl.training.rollout import make_rollout_engine

        kwargs = dict(model_path=model_path, max_new_tokens=self.max_new_tokens,
                      temperature=self.temperature, top_p=self.top_p)
        if self.kind == "transformers":
            kwargs.update(batch_size=self.batch_size, device=self.device, dtype=self.dtype)
        return make_rollout_engine(self.kind, **kwargs)

    def release(self) -> None:
        """Give the accelerator memory of a dropped engine back before the next stage's subprocess."""
        from batchrl.resources.compute import release_accelerator_memory

        release_accelerator_memory(self.device)
