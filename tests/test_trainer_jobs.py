"""Trainer jobs as real subprocesses: under Dagster Pipes, standalone, and killed then resumed."""
import json
import os
import signal
import subprocess
import time

import dagster as dg
import pytest
import torch
from safetensors.torch import load_file

from arith_pairs import build_arith_pairs

from batchrl.training.jobs import job_command
from batchrl.training.trainer.config import DPOConfig
from batchrl.training.trainer.dpo import train_dpo
from batchrl.training.trainer.reference import compute_reference_logprobs



@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("jobs")
    return {**build_arith_pairs(root, rejected_offset=2), "root": root}


def _write_config(path, **config):
    path.write_text(json.dumps(config))
    return str(path)


def test_jobs_under_dagster_pipes(inputs, tmp_path):
    ref_cfg = _write_config(tmp_path / "ref.json", model_path=inputs["model_path"], pairs_parquet=inputs["pairs_parquet"],
                            out_parquet=str(tmp_path / "ref" / "reference_logprobs.parquet"), max_length=64)
    dpo_cfg = _write_config(tmp_path / "dpo.json", trainer={"epochs": 2, "micro_batch_size": 8, "save_every": 2},
                            pairs_parquet=inputs["pairs_parquet"], model_path=inputs["model_path"],
                            reference_parquet=str(tmp_path / "ref" / "reference_logprobs.parquet"),
                            out_dir=str(tmp_path / "dpo"))

    @dg.asset
    def reference_logprobs(context: dg.AssetExecutionContext, pipes: dg.PipesSubprocessClient):
        return pipes.run(context=context, command=job_command("reference_logprobs", ref_cfg)).get_materialize_result()

    @dg.asset(deps=[reference_logprobs])
    def dpo_checkpoint(context: dg.AssetExecutionContext, pipes: dg.PipesSubprocessClient):
        return pipes.run(context=context, command=job_command("train_dpo", dpo_cfg)).get_materialize_result()

    result = dg.materialize([reference_logprobs, dpo_checkpoint], resources={"pipes": dg.PipesSubprocessClient()})
    assert result.success
    ref_meta = result.asset_materializations_for_node("reference_logprobs")[-1].metadata
    assert ref_meta["num_pairs"].value == 32
    mat = result.asset_materializations_for_node("dpo_checkpoint")[-1]
    meta = {k: v.value for k, v in mat.metadata.items()}
    assert meta["global_step"] == 8 and meta["margin_after"] > meta["margin_before"]
    assert len(meta["loss_curve"]) == 8 and "final/rewards/accuracies" in meta
    assert mat.tags["dagster/data_version"] == meta["content_hash"]
    assert os.path.exists(meta["model_dir"] + "/model.safetensors")
    logs = [e.message for e in result.all_events if e.event_type_value == "LOGS_CAPTURED" or e.message]
    assert logs


def test_job_runs_standalone_and_prints_json(inputs, tmp_path):
    ref = tmp_path / "ref.parquet"
    compute_reference_logprobs(inputs["model_path"], inputs["pairs_parquet"], str(ref), max_length=64)
    cfg = _write_config(tmp_path / "dpo.json", trainer={"epochs": 1, "micro_batch_size": 16},
                        pairs_parquet=inputs["pairs_parquet"], model_path=inputs["model_path"],
                        reference_parquet=str(ref), out_dir=str(tmp_path / "out"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("DAGSTER_PIPES")}
    proc = subprocess.run(job_command("train_dpo", cfg, num_gpus=1), capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    steps = [line for line in lines if "step" in line]
    assert [s["step"] for s in steps] == [1, 2] and all("loss" in s for s in steps)
    final = [line for line in lines if "materialization" in line][-1]
    assert final["materialization"]["global_step"] == 2 and len(final["data_version"]) == 64


def test_killed_job_resumes_to_the_uninterrupted_result(inputs, tmp_path):
    ref = tmp_path / "ref.parquet"
    compute_reference_logprobs(inputs["model_path"], inputs["pairs_parquet"], str(ref), max_length=64)
    trainer = {"epochs": 10, "micro_batch_size": 8, "save_every": 1, "lr": 1e-3}
    kw = dict(pairs_parquet=inputs["pairs_parquet"], model_path=inputs["model_path"], reference_parquet=str(ref))
    full = train_dpo(DPOConfig(**trainer), out_dir=str(tmp_path / "full"), **kw)

    cfg = _write_config(tmp_path / "dpo.json", trainer=trainer, out_dir=str(tmp_path / "cut"), **kw)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DAGSTER_PIPES")}
    proc = subprocess.Popen(job_command("train_dpo", cfg, num_gpus=1), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    latest = tmp_path / "cut" / "checkpoints" / "latest"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if latest.exists() and int(latest.read_text().split("_")[1]) >= 3:
            proc.send_signal(signal.SIGKILL)  # no cleanup, possibly in the middle of a save
            break
        time.sleep(0.02)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "job finished before it could be killed"
    assert not (tmp_path / "cut" / "model").exists()

    rerun = subprocess.run(job_command("train_dpo", cfg, num_gpus=1), env=env, capture_output=True, text=True,
                           timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    final = [json.loads(x) for x in rerun.stdout.splitlines() if x.startswith('{"materialization"')][-1]
    meta = final["materialization"]
    assert meta["resumed_from_step"] >= 3 and meta["global_step"] == full["global_step"] == 40
    assert meta["loss_curve"] == pytest.approx(full["loss_curve"], abs=1e-6)
    a, b = load_file(tmp_path / "full" / "model" / "model.safetensors"), load_file(tmp_path / "cut" / "model" / "model.safetensors")
    assert all(torch.allclose(a[k], b[k], atol=1e-6, rtol=0) for k in a)


def test_two_rank_data_parallel_matches_one_process(inputs, tmp_path):
    """torchrun with 2 CPU ranks (gloo), micro-batch 4 each == one process with micro-batch 8."""
    ref = tmp_path / "ref.parquet"
    compute_reference_logprobs(inputs["model_path"], inputs["pairs_parquet"], str(ref), max_length=64)
    kw = dict(pairs_parquet=inputs["pairs_parquet"], model_path=inputs["model_path"], reference_parquet=str(ref))
    single = train_dpo(DPOConfig(epochs=1, micro_batch_size=8), out_dir=str(tmp_path / "one"), **kw)
    cfg = _write_config(tmp_path / "dp.json", trainer={"epochs": 1, "micro_batch_size": 4, "save_every": 2},
                        out_dir=str(tmp_path / "two"), **kw)
    # this process's own rendezvous variables (set by the in-process run above) are inherited on purpose
    env = {k: v for k, v in os.environ.items() if not k.startswith("DAGSTER_PIPES")}
    proc = subprocess.run(job_command("train_dpo", cfg, num_gpus=2), env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith('{"materialization"')]
    assert len(final) == 1  # only rank 0 reports
    meta = final[0]["materialization"]
    assert meta["loss_curve"] == pytest.approx(single["loss_curve"], abs=1e-5)
    assert meta["margin_after"] == pytest.approx(single["margin_after"], abs=1e-4)
    ckpt = tmp_path / "two" / "checkpoints" / "step_00000004"
    assert (ckpt / "rng_rank0.pt").exists() and (ckpt / "rng_rank1.pt").exists()


def _run_job(job: str, config: str, num_gpus: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DAGSTER_PIPES")}
    proc = subprocess.run(job_command(job, config, num_gpus=num_gpus), env=env, capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith('{"materialization"')]
    assert len(final) == 1  # only rank 0 reports
    return final[0]["materialization"]


@pytest.mark.parametrize("zero_stage", [0, 2, 3])
def test_global_batch_is_the_same_on_one_or_two_ranks_and_resumes_on_another_count(inputs, tmp_path, zero_stage):
    """global_batch_size 8 with micro-batch 4: one process accumulates 2 micro-batches, two gloo ranks 1 each —
    the same loss curve; a run cut after 2 steps on 2 ranks resumes on 1 process to the same curve (ZeRO-2/3:
    through DeepSpeed's universal checkpoint, converted once next to the checkpoint)."""
    ref = tmp_path / "ref.parquet"
    compute_reference_logprobs(inputs["model_path"], inputs["pairs_parquet"], str(ref), max_length=64)
    kw = dict(pairs_parquet=inputs["pairs_parquet"], model_path=inputs["model_path"], reference_parquet=str(ref))
    trainer = {"epochs": 1, "micro_batch_size": 4, "global_batch_size": 8, "zero_stage": zero_stage, "save_every": 1}
    single = train_dpo(DPOConfig(**trainer), out_dir=str(tmp_path / "one"), **kw)
    assert single["global_step"] >= 4
    two = _run_job("train_dpo", _write_config(tmp_path / "two.json", trainer=trainer, out_dir=str(tmp_path / "two"),
                                              **kw), num_gpus=2)
    assert two["global_step"] == single["global_step"]
    assert two["loss_curve"] == pytest.approx(single["loss_curve"], abs=1e-5)
    cut = {**trainer, "stop_after_steps": 2}
    _run_job("train_dpo", _write_config(tmp_path / "cut.json", trainer=cut, out_dir=str(tmp_path / "cut"), **kw),
             num_gpus=2)
    resumed = _run_job("train_dpo", _write_config(tmp_path / "resume.json", trainer={**trainer, "keep_last": 9},
                                                  out_dir=str(tmp_path / "cut"), **kw), num_gpus=1)
    assert resumed["resumed_from_step"] == 2
    assert resumed["loss_curve"] == pytest.approx(single["loss_curve"], abs=1e-5)
    assert os.path.isdir(tmp_path / "cut" / "checkpoints" / "step_00000002" / "universal") == bool(zero_stage)


def test_reward_model_zero3_on_two_ranks_equals_one_process(inputs, tmp_path):
    """The reward-model trainer, data-parallel under ZeRO-3 on 2 gloo ranks, follows the one-process curve."""
    from batchrl.training.trainer.config import RewardModelConfig
    from batchrl.training.trainer.reward import train_reward_model

    trainer = {"epochs": 1, "micro_batch_size": 4, "global_batch_size": 8, "zero_stage": 3, "max_length": 64}
    kw = dict(pairs_parquet=inputs["pairs_parquet"], model_path=inputs["model_path"])
    single = train_reward_model(RewardModelConfig(**trainer), out_dir=str(tmp_path / "one"), **kw)
    two = _run_job("train_reward_model", _write_config(tmp_path / "rm.json", trainer=trainer,
                                                       out_dir=str(tmp_path / "two"), **kw), num_gpus=2)
    assert two["loss_curve"] == pytest.approx(single["loss_curve"], abs=1e-5)
    assert two["train_accuracy_after"] == pytest.approx(single["train_accuracy_after"])
    one_w = load_file(tmp_path / "one" / "model" / "model.safetensors")
    two_w = load_file(tmp_path / "two" / "model" / "model.safetensors")
    assert one_w.keys() == two_w.keys() and all(torch.allclose(one_w[k], two_w[k], atol=1e-5) for k in one_w)


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_policy_update_on_two_ranks_equals_one_process(inputs, tmp_path, zero_stage):
    """The PPO/GRPO update, data-parallel on 2 gloo ranks under ZeRO-2/3 (torchrun), follows the one-process
    curve with the same global batch and exports the same model (to float rounding)."""
    import numpy as np
    import pandas as pd

    from batchrl.training.advantages import compute_advantages
    from batchrl.training.trainer.config import PolicyConfig
    from batchrl.training.trainer.policy import train_policy

    rng = np.random.default_rng(0)
    rows = [{"prompt_index": i // 4, "prompt_ids": [1, 2, 3 + i % 5], "reward": float(i % 2),
             "response_ids": list(rng.integers(3, 60, 1 + i % 4))} for i in range(32)]
    compute_advantages(pd.DataFrame(rows), "grpo").to_parquet(tmp_path / "batch.parquet")
    trainer = {"micro_batch_size": 4, "global_batch_size": 8, "ppo_epochs": 2, "kl_coef": 0.05, "lr": 1e-3,
               "zero_stage": zero_stage}
    kw = dict(batch_parquet=str(tmp_path / "batch.parquet"), model_path=inputs["model_path"],
              reference_model_path=inputs["model_path"])
    single = train_policy(PolicyConfig(**trainer), out_dir=str(tmp_path / "one"), **kw)
    two = _run_job("train_policy", _write_config(tmp_path / "two.json", trainer=trainer, out_dir=str(tmp_path / "two"),
                                                 **kw), num_gpus=2)
    assert two["global_step"] == single["global_step"] == 8
    assert two["loss_curve"] == pytest.approx(single["loss_curve"], abs=1e-5)
    a, b = (load_file(tmp_path / name / "model" / "model.safetensors") for name in ("one", "two"))
    assert all(torch.allclose(a[k], b[k], atol=1e-5, rtol=0) for k in a)


@pytest.mark.parametrize("setting, cudnn", [(None, False), ("0", False), ("1", True)])
def test_jobs_choose_cudnn_attention_per_job(tmp_path, monkeypatch, setting, cudnn):
    """cuDNN attention (a plan built per new batch shape) is off in a job unless BATCHRL_CUDNN_ATTENTION=1 —
    decided per job, as the warm worker runs jobs of either setting in one process."""
    import torch

    from batchrl.training.jobs._runtime import run_job

    if setting is None:
        monkeypatch.delenv("BATCHRL_CUDNN_ATTENTION", raising=False)
    else:
        monkeypatch.setenv("BATCHRL_CUDNN_ATTENTION", setting)
    torch.backends.cuda.enable_cudnn_sdp(not cudnn)  # the last job's opposite setting
    config = tmp_path / "job.json"
    config.write_text("{}")
    seen = []
    run_job(lambda cfg, rep: (seen.append(torch.backends.cuda.cudnn_sdp_enabled()) or {}, None), [str(config)])
    torch.backends.cuda.enable_cudnn_sdp(True)
    assert seen == [cudnn]
