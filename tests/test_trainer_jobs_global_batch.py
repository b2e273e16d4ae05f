"""A global batch is the same on one process or two ranks, whatever the ZeRO stage, and a run cut on two ranks
resumes on one to the same curve (ZeRO-2/3: through DeepSpeed's universal checkpoint)."""
import os

import pytest
from helpers_jobs import dpo_job_inputs, run_job, write_config

from batchrl.training.trainer.config import DPOConfig
from batchrl.training.trainer.dpo import train_dpo


@pytest.mark.parametrize("zero_stage", [0, 2, 3])
def test_global_batch_is_the_same_on_one_or_two_ranks_and_resumes_on_another_count(arith_job_inputs, tmp_path,
                                                                                   zero_stage):
    """global_batch_size 8 with micro-batch 4: one process accumulates 2 micro-batches, two gloo ranks 1 each —
    the same loss curve; a run cut after 2 steps on 2 ranks resumes on 1 process to the same curve (ZeRO-2/3:
    through DeepSpeed's universal checkpoint, converted once next to the checkpoint). The cut run's own steps are
    the two-rank curve (a whole two-rank run to its export: test_trainer_jobs_data_parallel.py): one torchrun
    start less per stage than a separate two-rank run (~20 s each on 2 cores)."""
    kw = dpo_job_inputs(arith_job_inputs, tmp_path)
    trainer = {"epochs": 1, "micro_batch_size": 4, "global_batch_size": 8, "zero_stage": zero_stage, "save_every": 1}
    single = train_dpo(DPOConfig(**trainer), out_dir=str(tmp_path / "one"), **kw)
    assert single["global_step"] >= 4
    cut = run_job("train_dpo", write_config(tmp_path / "cut.json", trainer={**trainer, "stop_after_steps": 2},
                                            out_dir=str(tmp_path / "cut"), **kw), num_gpus=2)
    assert cut["stopped_early"] and cut["world_size"] == 2 and cut["global_step"] == 2
    assert cut["loss_curve"] == pytest.approx(single["loss_curve"][:2], abs=1e-5)
    resumed = run_job("train_dpo", write_config(tmp_path / "resume.json", trainer={**trainer, "keep_last": 9},
                                                out_dir=str(tmp_path / "cut"), **kw), num_gpus=1)
    assert resumed["resumed_from_step"] == 2 and resumed["global_step"] == single["global_step"]
    assert resumed["loss_curve"] == pytest.approx(single["loss_curve"], abs=1e-5)
    assert os.path.isdir(tmp_path / "cut" / "checkpoints" / "step_00000002" / "universal") == bool(zero_stage)
