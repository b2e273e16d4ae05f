"""What the trainer-job tests share: a job's config file, its environment outside Dagster Pipes, a job run as a
subprocess (its one materialisation), and the reference log-probs a DPO job trains against."""
from __future__ import annotations

import json
import os
import subprocess

from batchrl.training.jobs import job_command
from batchrl.training.trainer.reference import compute_reference_logprobs


def write_config(path, **config) -> str:
    path.write_text(json.dumps(config))
    return str(path)


def standalone_env() -> dict:
    """This process's environment without Dagster Pipes' variables: the job runs as a user would start it."""
    return {k: v for k, v in os.environ.items() if not k.startswith("DAGSTER_PIPES")}


def run_job(job: str, config: str, num_gpus: int) -> dict:
    """The materialisation of ``job`` run standalone on ``num_gpus`` ranks; only rank 0 reports one."""
    proc = subprocess.run(job_command(job, config, num_gpus=num_gpus), env=standalone_env(), capture_output=True,
                          text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith('{"materialization"')]
    assert len(final) == 1  # only rank 0 reports
    return final[0]["materialization"]


def dpo_job_inputs(inputs: dict, tmp_path) -> dict:
    """The pairs, the model and their reference log-probs (written under ``tmp_path``): a DPO job's inputs."""
    ref = tmp_path / "ref.parquet"
    compute_reference_logprobs(inputs["model_path"], inputs["pairs_parquet"], str(ref), max_length=64)
    return dict(pairs_parquet=inputs["pairs_parquet"], model_path=inputs["model_path"], reference_parquet=str(ref))
