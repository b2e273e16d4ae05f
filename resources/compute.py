"""Where in-process model work runs (evaluation, reward-model scoring): the CPU, or the accelerator.

Swapped per environment like every resource: ``local`` keeps float32 on the CPU, ``gpu`` puts the
same code on CUDA in bfloat16. Stages that train run in subprocesses (the trainer launcher) instead.
"""
from __future__ import annotations

import dagster as dg


class ComputeResource(dg.ConfigurableResource):
    device: str = "cpu"  # "cpu" | "cuda" | "cuda:N"
    dtype: str = "float32"  # weights' dtype for inference: float32 | bfloat16 | float16
    batch_size: int = 32  # sequences per forward pass (evaluation, reward-model scoring)

    def release(self) -> None:
        release_accelerator_memory(self.device)


def release_accelerator_memory(device: str) -> None:
    """Give cached accelerator memory back after a stage, so the next stage's subprocess can use it."""
    import gc

    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()
