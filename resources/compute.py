"""Where model work of the non-training stages runs (reward-model scoring, advantages, evaluation): on the CPU
in the Dagster process, or on the accelerator in a Pipes subprocess (its memory is gone when the stage
ends). Swapped per environment like every resource: ``local`` keeps float32 on the CPU in process,
``gpu`` runs the same tasks on CUDA in bfloat16 in a subprocess. Training stages always run as jobs.
"""
from __future__ import annotations

import json
import os

import dagster as dg
from pydantic import Field

from batchrl.common.plot_keys import numbers_as_text_when_not_plotted


class ComputeResource(dg.ConfigurableResource):
    device: str = Field("cpu", description='"cpu" | "cuda" | "cuda:N"')
    dtype: str = Field("float32", description="weights' dtype for inference: float32 | bfloat16 | float16")
    batch_size: int = Field(32, description="sequences per forward pass (evaluation, reward-model scoring)")
    generation_engine: str = Field("transformers", description="evaluation's greedy decoding: transformers | "
                                   "static (static KV cache + CUDA graphs, Llama-family models)")
    in_subprocess: bool = Field(False, description="run the tasks in a Pipes subprocess instead of in process")

    def run(self, context: dg.AssetExecutionContext, launcher, task: str, config: dict, workdir: str,
            uses_models: bool = True) -> dict:
        """Run an inference task (``batchrl.training.jobs.inference.TASKS``) here or as a job; its result.
        ``uses_models`` False (rule rewards alone, advantages without a reference or critic): in process on the CPU
        whatever ``in_subprocess`` says — the job would only add its hand-off (~0.2-0.3 s a stage on the H200, twice
        an RL iteration) to arithmetic over a table."""
        from batchrl.training.jobs.inference import run_task

        config = {**config, "task": task, "result_json": os.path.join(workdir, f"{task}_result.json")}
        if not uses_models:
            return run_task({**config, "device": "cpu"})
        if self.in_subprocess:
            reported = launcher.run_job(context, "inference", config, workdir).metadata or {}
            # where the job's time went (load, tokenise, score...) and whether its models came from the worker's
            # weight cache: on the asset's materialisation, beside its own
            context.add_output_metadata(numbers_as_text_when_not_plotted({
                k: getattr(v, "value", v) for k, v in reported.items() if k.startswith(("phase_s/", "weight_cache_"))}))
            with open(config["result_json"]) as f:
                return json.load(f)
        result = run_task(config)
        self.release()
        return result

    def release(self) -> None:
        release_accelerator_memory(self.device)


def release_accelerator_memory(device: str) -> None:
    """Give cached accelerator memory back after a stage, so the next stage's subprocess can use it."""
    import gc

    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()
