"""Trainer jobs as real subprocesses: under Dagster Pipes, standalone, and killed then resumed. (Data-parallel
jobs: test_trainer_jobs_data_parallel.py and test_trainer_jobs_global_batch.py.)"""
import json
import os
import signal
import subprocess
import time

import dagster as dg
import pytest
import torch
from helpers_jobs import dpo_job_inputs, standalone_env, write_config
from safetensors.torch import load_file

from batchrl.training.jobs import job_command
from batchrl.training.trainer.config import DPOConfig
from batchrl.training.trainer.dpo import train_dpo


def test_jobs_under_dagster_pipes(arith_job_inputs, tmp_path):
    inputs = arith_job_inputs
    ref_cfg = write_config(tmp_path / "ref.json", model_path=inputs["model_path"],
                           pairs_parquet=inputs["pairs_parquet"], out_parquet=str(tmp_path / "ref" / "reference_logprobs.parquet"), max_length=64)
    dpo_cfg = write_config(tmp_path / "dpo.json", trainer={"epochs": 2, "micro_batch_size": 8, "save_every": 2},
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


def test_job_runs_standalone_and_prints_json(arith_job_inputs, tmp_path):
    cfg = write_config(tmp_path / "dpo.json", trainer={"epochs": 1, "micro_batch_size": 16},
                       out_dir=str(tmp_path / "out"), **dpo_job_inputs(arith_job_inputs, tmp_path))
    proc = subprocess.run(job_command("train_dpo", cfg, num_gpus=1), capture_output=True, text=True,
                          env=standalone_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    steps = [line for line in lines if "step" in line]
    assert [s["step"] for s in steps] == [1, 2] and all("loss" in s for s in steps)
    final = [line for line in lines if "materialization" in line][-1]
    assert final["materialization"]["global_step"] == 2 and len(final["data_version"]) == 64
    assert not any(k.startswith("gpu_") for k in final["materialization"])  # a CPU job initialises no CUDA


def test_a_gpu_job_reports_its_peak_memory_and_the_headroom_left():
    """``gpu_memory``: the numbers a GPU job's metadata carries (CUDA cannot run on this box; a stand-in for
    ``torch.cuda``'s four calls), in decimal GB."""
    from types import SimpleNamespace

    from batchrl.training.jobs._runtime import gpu_memory

    cuda = SimpleNamespace(mem_get_info=lambda: (12.5e9, 85.0e9), max_memory_allocated=lambda: 61.234e9,
                           max_memory_reserved=lambda: 66.0e9)
    assert gpu_memory(cuda) == {"gpu_peak_allocated_gb": 61.23, "gpu_peak_reserved_gb": 66.0,
                                "gpu_free_gb_after": 12.5, "gpu_total_gb": 85.0}
    assert gpu_memory(None) == {}


def test_killed_job_resumes_to_the_uninterrupted_result(arith_job_inputs, tmp_path):
    # 5 epochs of 4 steps: room to be killed after step 3, before the end
    trainer = {"epochs": 5, "micro_batch_size": 8, "save_every": 1, "lr": 1e-3}
    kw = dpo_job_inputs(arith_job_inputs, tmp_path)
    full = train_dpo(DPOConfig(**trainer), out_dir=str(tmp_path / "full"), **kw)

    cfg = write_config(tmp_path / "dpo.json", trainer=trainer, out_dir=str(tmp_path / "cut"), **kw)
    env = standalone_env()
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
    assert meta["resumed_from_step"] >= 3 and meta["global_step"] == full["global_step"] == 20
    assert meta["loss_curve"] == pytest.approx(full["loss_curve"], abs=1e-6)
    a, b = load_file(tmp_path / "full" / "model" / "model.safetensors"), load_file(tmp_path / "cut" / "model" / "model.safetensors")
    assert all(torch.allclose(a[k], b[k], atol=1e-6, rtol=0) for k in a)


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
