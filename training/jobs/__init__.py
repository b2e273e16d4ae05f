"""Subprocess entry points for the heavy stages, started by Dagster through Pipes.

Each job is ``python -m batchrl.training.jobs.<job> <config.json>``; the JSON holds
``{"trainer": {...TrainerConfig fields...}, <input paths>, "out_dir": ...}``. Jobs report metrics
and their materialisation through Dagster Pipes when launched by Dagster, and print JSON lines
otherwise, so the same command runs by hand, under Pipes, or in a GPU pod (PipesK8sClient).
"""
from __future__ import annotations

import os
import sys

from batchrl.common.environment_variables import read

TRAINING_JOBS = ("train_dpo", "train_kto", "train_policy", "train_reward_model")  # data-parallel over N GPUs
JOBS = (*TRAINING_JOBS, "reference_logprobs", "rollouts", "inference")  # the others run in one process
# NVLink multicast (NVLS) off: on the lent multi-GPU hosts it hangs or fails collectives.
MULTI_GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def job_command(job_name: str, config_path: str, num_gpus: int | None = None) -> list[str]:
    """Command line for a job: one process (CPU/gloo or one GPU), or for a training job with ``num_gpus > 1``
    (default ``$BATCHRL_NUM_GPUS``) one process per GPU under torchrun (``--standalone`` picks a free port;
    the same command runs data-parallel on CPU with gloo, which the tests use)."""
    if job_name not in JOBS:
        raise ValueError(f"unknown job {job_name!r}; expected one of {JOBS}")
    module = f"batchrl.training.jobs.{job_name}"
    if num_gpus is None:
        num_gpus = read("BATCHRL_NUM_GPUS")
    if num_gpus > 1 and job_name in TRAINING_JOBS:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={num_gpus}",
                "-m", module, config_path]
    return [sys.executable, "-m", module, config_path]
