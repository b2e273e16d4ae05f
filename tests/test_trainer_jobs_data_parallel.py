"""Data-parallel trainer jobs: DPO, the reward model and the policy update on 2 gloo ranks under torchrun follow
the one-process curve (micro-batches summing to the same global batch)."""
import json
import subprocess

import numpy as np
import pandas as pd
import pytest
import torch
from helpers_jobs import dpo_job_inputs, run_job, standalone_env, write_config
from safetensors.torch import load_file

from batchrl.training.jobs import job_command
from batchrl.training.trainer.config import DPOConfig
from batchrl.training.trainer.dpo import train_dpo


def test_two_rank_data_parallel_matches_one_process(arith_job_inputs, tmp_path):
    """torchrun with 2 CPU ranks (gloo), micro-batch 4 each == one process with micro-batch 8."""
    kw = dpo_job_inputs(arith_job_inputs, tmp_path)
    single = train_dpo(DPOConfig(epochs=1, micro_batch_size=8), out_dir=str(tmp_path / "one"), **kw)
    cfg = write_config(tmp_path / "dp.json", trainer={"epochs": 1, "micro_batch_size": 4, "save_every": 2},
                       out_dir=str(tmp_path / "two"), **kw)
    # this process's own rendezvous variables (set by the in-process run above) are inherited on purpose
    proc = subprocess.run(job_command("train_dpo", cfg, num_gpus=2), env=standalone_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith('{"materialization"')]
    assert len(final) == 1  # only rank 0 reports
    meta = final[0]["materialization"]
    assert meta["loss_curve"] == pytest.approx(single["loss_curve"], abs=1e-5)
    assert meta["margin_after"] == pytest.approx(single["margin_after"], abs=1e-4)
    ckpt = tmp_path / "two" / "checkpoints" / "step_00000004"
    assert (ckpt / "rng_rank0.pt").exists() and (ckpt / "rng_rank1.pt").exists()


def test_reward_model_zero3_on_two_ranks_equals_one_process(arith_job_inputs, tmp_path):
    """The reward-model trainer, data-parallel under ZeRO-3 on 2 gloo ranks, follows the one-process curve."""
    from batchrl.training.trainer.config import RewardModelConfig
    from batchrl.training.trainer.reward import train_reward_model

    trainer = {"epochs": 1, "micro_batch_size": 4, "global_batch_size": 8, "zero_stage": 3, "max_length": 64}
    kw = dict(pairs_parquet=arith_job_inputs["pairs_parquet"], model_path=arith_job_inputs["model_path"])
    single = train_reward_model(RewardModelConfig(**trainer), out_dir=str(tmp_path / "one"), **kw)
    two = run_job("train_reward_model", write_config(tmp_path / "rm.json", trainer=trainer,
                                                     out_dir=str(tmp_path / "two"), **kw), num_gpus=2)
    assert two["loss_curve"] == pytest.approx(single["loss_curve"], abs=1e-5)
    assert two["train_accuracy_after"] == pytest.approx(single["train_accuracy_after"])
    one_w = load_file(tmp_path / "one" / "model" / "model.safetensors")
    two_w = load_file(tmp_path / "two" / "model" / "model.safetensors")
    assert one_w.keys() == two_w.keys() and all(torch.allclose(one_w[k], two_w[k], atol=1e-5) for k in one_w)


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_policy_update_on_two_ranks_equals_one_process(arith_job_inputs, tmp_path, zero_stage):
    """The PPO/GRPO update, data-parallel on 2 gloo ranks under ZeRO-2/3 (torchrun), follows the one-process
    curve with the same global batch and exports the same model (to float rounding)."""
    from batchrl.training.rl.advantages import compute_advantages
    from batchrl.training.trainer.config import PolicyConfig
    from batchrl.training.trainer.policy import train_policy

    rng = np.random.default_rng(0)
    rows = [{"prompt_index": i // 4, "prompt_ids": [1, 2, 3 + i % 5], "reward": float(i % 2),
             "response_ids": list(rng.integers(3, 60, 1 + i % 4))} for i in range(32)]
    compute_advantages(pd.DataFrame(rows), "grpo").to_parquet(tmp_path / "batch.parquet")
    trainer = {"micro_batch_size": 4, "global_batch_size": 8, "ppo_epochs": 2, "kl_loss_coef": 0.05, "lr": 1e-3,
               "zero_stage": zero_stage}
    kw = dict(batch_parquet=str(tmp_path / "batch.parquet"), model_path=arith_job_inputs["model_path"],
              reference_model_path=arith_job_inputs["model_path"])
    single = train_policy(PolicyConfig(**trainer), out_dir=str(tmp_path / "one"), **kw)
    two = run_job("train_policy", write_config(tmp_path / "two.json", trainer=trainer, out_dir=str(tmp_path / "two"),
                                               **kw), num_gpus=2)
    assert two["global_step"] == single["global_step"] == 8
    assert two["loss_curve"] == pytest.approx(single["loss_curve"], abs=1e-5)
    a, b = (load_file(tmp_path / name / "model" / "model.safetensors") for name in ("one", "two"))
    assert all(torch.allclose(a[k], b[k], atol=1e-5, rtol=0) for k in a)
