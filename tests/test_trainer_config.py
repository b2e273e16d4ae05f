"""Trainer configs, DeepSpeed config dict, batch fitting, job command lines, advantages table."""
import sys

import numpy as np
import pandas as pd
import pytest
from pydantic import ValidationError

from batchrl.training.rl.advantages import compute_advantages
from batchrl.training.data.batch_layout import pad_prompt_completion
from batchrl.training.jobs import job_command
from batchrl.training.trainer.batching import epoch_order
from batchrl.training.trainer.config import DPOConfig, PolicyConfig
from batchrl.training.trainer.engine import deepspeed_config
from batchrl.training.trainer.loop import fit_batch


@pytest.mark.parametrize("cls", [DPOConfig, PolicyConfig])
def test_config_json_round_trip(cls, tmp_path):
    cfg = cls(lr=3e-4, seed=7, zero_stage=2, keep_last=3)
    assert cls.from_json(cfg.to_json()) == cfg
    cfg.save(tmp_path / "c.json")
    assert cls.load(tmp_path / "c.json") == cfg


def test_config_defaults_and_validation():
    dpo, pol = DPOConfig(), PolicyConfig()
    assert (dpo.beta, dpo.loss_type, dpo.max_length, dpo.keep_last) == (0.1, "sigmoid", 256, 2)
    assert (pol.adv_estimator, pol.policy_loss, pol.kl_loss_coef, pol.kl_loss_type) == \
        ("grpo", "vanilla", 0.01, "low_var_kl")
    assert pol.clip_ratio_low == pol.clip_ratio_high == 0.2 and pol.clip_ratio_c == 3.0
    with pytest.raises(ValidationError):
        DPOConfig(lr=-1)
    with pytest.raises(ValidationError):
        DPOConfig(loss_type="nope")
    with pytest.raises(ValidationError, match="simpo_gamma is SimPO's margin"):
        DPOConfig(loss_type="sigmoid", simpo_gamma=1.0)
    with pytest.raises(ValidationError):
        PolicyConfig(unknown_field=1)  # typos fail loudly
    with pytest.raises(ValidationError):
        PolicyConfig(zero_stage=4)


def test_deepspeed_config_cpu_keeps_fp32():
    ds = deepspeed_config(DPOConfig(micro_batch_size=4, grad_accum=3, zero_stage=1, precision="bf16"))
    assert ds["train_batch_size"] == 12 and ds["gradient_accumulation_steps"] == 3
    assert ds["zero_optimization"]["stage"] == 1
    assert ds["bf16"]["enabled"] is False  # no GPU here: bf16 is a GPU-only setting
    assert ds["gradient_clipping"] == 1.0


def test_fit_batch_shrinks_to_available_rows():
    cfg = PolicyConfig(micro_batch_size=16, grad_accum=4)
    assert fit_batch(cfg, 1000) is cfg
    small = fit_batch(cfg, 10)
    assert small.micro_batch_size * small.grad_accum <= 10 and small.grad_accum == 4
    assert fit_batch(cfg, 2).grad_accum == 2


def test_job_command_single_and_multi_gpu(monkeypatch):
    monkeypatch.delenv("BATCHRL_NUM_GPUS", raising=False)
    assert job_command("train_dpo", "/c.json") == [sys.executable, "-m", "batchrl.training.jobs.train_dpo", "/c.json"]
    multi = job_command("train_policy", "/c.json", num_gpus=2)
    assert "--nproc_per_node=2" in multi
    assert multi[-1] == "/c.json" and "batchrl.training.jobs.train_policy" in multi
    monkeypatch.setenv("BATCHRL_NUM_GPUS", "4")
    assert "--nproc_per_node=4" in job_command("train_dpo", "/c.json")
    with pytest.raises(ValueError):
        job_command("rm_rf", "/c.json")
    # inference and sampling jobs stay one process: only trainers are data-parallel
    assert job_command("rollouts", "/c.json") == [sys.executable, "-m", "batchrl.training.jobs.rollouts", "/c.json"]
    assert "--nproc_per_node=4" in job_command("train_reward_model", "/c.json")
    # the launcher resource's num_gpus decides, whatever this (Dagster) process's environment says
    from batchrl.resources import TrainerLauncherResource

    assert "--nproc_per_node=2" in TrainerLauncherResource(num_gpus=2).command("train_dpo", "/c.json")
    assert "torch.distributed.run" not in TrainerLauncherResource(num_gpus=1).command("train_dpo", "/c.json")


def test_global_batch_size_sets_accumulation_per_rank_count(monkeypatch):
    cfg = DPOConfig(micro_batch_size=4, global_batch_size=16)
    assert fit_batch(cfg, 1000).grad_accum == 4
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert fit_batch(cfg, 1000).grad_accum == 2
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="not a multiple of micro_batch_size 4 x 3 ranks"):
        fit_batch(cfg, 1000)
    with pytest.raises(ValidationError, match="global_batch_size 10 is not a multiple of micro_batch_size 4"):
        DPOConfig(micro_batch_size=4, global_batch_size=10)


def test_launcher_turns_nvlink_multicast_off_for_multi_gpu_jobs(monkeypatch):
    from batchrl.resources import TrainerLauncherResource

    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    two = TrainerLauncherResource(num_gpus=2).job_env()
    assert (two["NCCL_NVLS_ENABLE"], two["TORCH_SYMM_MEM_DISABLE_MULTICAST"], two["BATCHRL_NUM_GPUS"]) == ("0", "1", "2")
    assert "NCCL_NVLS_ENABLE" not in TrainerLauncherResource(num_gpus=1).job_env()
    assert TrainerLauncherResource(num_gpus=2, env={"NCCL_NVLS_ENABLE": "1"}).job_env()["NCCL_NVLS_ENABLE"] == "1"


def test_padding_layout_positions_ignore_padding():
    b = pad_prompt_completion([[5, 6, 7], [8]], [[1], [2, 3, 4]], pad_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 7, 1, 0, 0], [0, 0, 8, 2, 3, 4]]
    assert b["position_ids"][1, 2:].tolist() == [0, 1, 2, 3]
    assert b["response_mask"].tolist() == [[1, 0, 0], [1, 1, 1]]
    assert (epoch_order(10, 0, 1) == epoch_order(10, 0, 1)).all()
    assert not (epoch_order(10, 0, 1) == epoch_order(10, 0, 2)).all()


def test_compute_advantages_grpo_outcome_on_tokens():
    table = pd.DataFrame({"prompt_index": [0, 0, 1, 1], "response_ids": [[1, 2, 3], [4], [5, 6], [7, 8]],
                          "reward": [1.0, 0.0, 0.5, 0.5]})
    out = compute_advantages(table, "grpo")
    assert [len(a) for a in out["advantages"]] == [3, 1, 2, 2]
    # group 0: scores (1, 0), unbiased std 0.707 -> +-0.707 broadcast over each response's tokens
    np.testing.assert_allclose(out["advantages"][0], [0.7071] * 3, atol=1e-3)
    np.testing.assert_allclose(out["advantages"][1], [-0.7071], atol=1e-3)
    np.testing.assert_allclose(out["advantages"][2] + out["advantages"][3], [0.0] * 4, atol=1e-5)
    rloo = compute_advantages(table, "rloo")
    np.testing.assert_allclose(rloo["advantages"][0], [1.0] * 3, atol=1e-5)
    assert "returns" in out and list(table.columns) == list(out.columns[:3])


@pytest.mark.parametrize("schedule,expected", [("constant", [0.5, 1, 1, 1, 1]), ("linear", [0.5, 1, 2 / 3, 1 / 3, 0]),
                                               ("cosine", [0.5, 1, 0.75, 0.25, 0])])
def test_lr_schedules(schedule, expected):
    import torch

    from batchrl.training.trainer.engine import make_scheduler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = make_scheduler(opt, DPOConfig(warmup_steps=1, lr_schedule=schedule), total_steps=4)
    lrs = []
    for _ in range(5):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step(), sched.step()
    np.testing.assert_allclose(lrs, expected, atol=1e-9)
