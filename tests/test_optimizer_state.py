"""AdamW's state carried from one RL iteration's policy update into the next (``carry_optimizer_state``,
``training/trainer/optimizer_state.py``): a chain of update jobs steps as one optimiser would, the state is part of
the checkpoint's files (so of its data version) and the same inputs give the same bytes."""
from __future__ import annotations

import os

import numpy as np
import pandas as pd
import pytest
import torch

from arith_pairs import build_arith_pairs

from batchrl.training.rl.advantages import compute_advantages
from batchrl.training.jobs._runtime import tree_hash
from batchrl.training.models.loading import load_model_and_tokenizer
from batchrl.training.trainer import optimizer_state
from batchrl.training.trainer.config import PolicyConfig
from batchrl.training.trainer.engine import make_optimizer
from batchrl.training.trainer.policy import train_policy

LORA = dict(lora_rank=4, lora_alpha=8)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    return build_arith_pairs(tmp_path_factory.mktemp("carry"), rejected_offset=3)["model_path"]


def _batch(path, seed: int) -> str:
    rng = np.random.default_rng(seed)
    rows = [{"prompt_index": i // 4, "prompt_ids": [1, 2, 3 + i % 5], "response_ids": list(rng.integers(3, 60, 1 + i % 4)),
             "reward": float(rng.random() < 0.5)} for i in range(32)]
    compute_advantages(pd.DataFrame(rows), "grpo").to_parquet(path)
    return str(path)


def _lm_steps(model, optimizer, seed: int, steps: int = 3) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(3, 60, (4, 12), generator=generator)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def test_a_saved_and_taken_up_state_steps_as_the_optimiser_that_never_stopped(base, tmp_path, monkeypatch):
    monkeypatch.setattr(optimizer_state, "SHARD_BYTES", 64 * 1024)  # several shards, written side by side
    cfg = PolicyConfig(lr=1e-2, weight_decay=0.01)
    model, _ = load_model_and_tokenizer(base)
    optimizer = make_optimizer(model, cfg)
    _lm_steps(model, optimizer, seed=0)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    assert optimizer_state.save(optimizer, model, str(tmp_path)) == 3
    assert len(os.listdir(tmp_path / optimizer_state.FOLDER)) > 2
    _lm_steps(model, optimizer, seed=1)  # the optimiser that never stopped

    def continued(carry: bool):
        again, _ = load_model_and_tokenizer(base)
        again.load_state_dict(weights)
        new = make_optimizer(again, cfg)
        if carry:
            assert optimizer_state.load(new, again, str(tmp_path)) == 3
        _lm_steps(again, new, seed=1)
        return again.state_dict()

    carried, fresh = continued(True), continued(False)
    assert all(torch.equal(carried[k], v) for k, v in model.state_dict().items())
    assert any(not torch.equal(fresh[k], v) for k, v in model.state_dict().items())
    # a folder without a state is a new optimiser; a state of another model is refused naming the file
    assert optimizer_state.load(make_optimizer(model, cfg), model, str(tmp_path / "none")) is None
    other = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="optimizer: optimiser state for .* not train"):
        optimizer_state.load(make_optimizer(other, cfg), other, str(tmp_path))


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_chain_of_updates_carries_its_optimiser_and_the_state_is_in_the_checkpoint(base, tmp_path, lora):
    cfg = PolicyConfig(micro_batch_size=8, lr=1e-2, kl_loss_coef=0.05, carry_optimizer_state=True, **(LORA if lora else {}))
    batches = [_batch(tmp_path / f"batch{i}.parquet", i) for i in range(2)]
    first = train_policy(cfg, batch_parquet=batches[0], model_path=base, reference_model_path=base,
                         out_dir=str(tmp_path / "it0"))
    assert first["optimizer_state"].startswith("new:") and first["optimizer_state_step"] == 4
    kept = optimizer_state.read(first["model_dir"])
    assert all(("lora_" in key) == lora for key in kept)  # LoRA: the adapters' moments only
    runs = {}
    for name, carry in (("carried", True), ("again", True), ("fresh", False)):
        runs[name] = train_policy(cfg.model_copy(update={"carry_optimizer_state": carry}), batch_parquet=batches[1],
                                  model_path=first["model_dir"], reference_model_path=base,
                                  out_dir=str(tmp_path / name))
    assert runs["carried"]["optimizer_state"] == "carried from step 4" and runs["carried"]["optimizer_state_step"] == 8
    assert "optimizer_state" not in runs["fresh"] and optimizer_state.read(runs["fresh"]["model_dir"]) is None
    # the same inputs give the same files (the data version); carrying changes the update
    versions = {name: tree_hash(run["model_dir"]) for name, run in runs.items()}  # as the job hashes its export
    assert versions["carried"] == versions["again"] != versions["fresh"]
    assert runs["carried"]["loss_curve"] != runs["fresh"]["loss_curve"]


def test_carrying_needs_the_trainers_own_adamw():
    from batchrl.assets.run_rules import check_run_config
    from batchrl.runs.run_config import RunConfigError

    for refused in ({"zero_stage": 2}, {"precision": "bf16"}):
        with pytest.raises(ValueError, match="carry_optimizer_state"):
            PolicyConfig(carry_optimizer_state=True, **refused)
        with pytest.raises(RunConfigError, match="carry_optimizer_state"):  # before a run starts
            check_run_config({"ops": {"policy_checkpoint": {"config": {"carry_optimizer_state": True, **refused}}}})
    PolicyConfig(carry_optimizer_state=True, precision="bf16_amp")
