"""Trainer launcher: runs a training job as a subprocess through Dagster Pipes.

Locally the job is `python -m batchrl.training.jobs.<job>` (DeepSpeed on CPU with gloo); with
``num_gpus > 1`` it goes through the deepspeed launcher. At cluster scale swap this resource for one
built on ``PipesK8sClient`` with a GPU pod spec: the job code and its reporting stay the same.
"""
from __future__ import annotations

import json
import os
from typing import Any

import dagster as dg


class TrainerLauncherResource(dg.ConfigurableResource):
    num_gpus: int = 0
    env: dict[str, str] = {}

    def run_job(self, context: dg.AssetExecutionContext, job: str, config: dict[str, Any],
                workdir: str) -> dg.MaterializeResult:
        from batchrl.training.jobs import job_command

        config_path = os.path.join(workdir, f"{job}.json")
        with open(config_path, "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
        client = dg.PipesSubprocessClient(env=self.job_env(), cwd=workdir)
        invocation = client.run(context=context, command=job_command(job, config_path))
        return invocation.get_materialize_result()

    def job_env(self) -> dict[str, str]:
        """The children's environment: ours, NVLink multicast off with several GPUs, then ``env``."""
        from batchrl.training.jobs import MULTI_GPU_ENV

        return {**os.environ, **(MULTI_GPU_ENV if self.num_gpus > 1 else {}), **self.env,
                "BATCHRL_NUM_GPUS": str(self.num_gpus)}
