"""A step whose gradients hold NaN changes nothing (the trainer skips it and counts it), and trained weights that
hold NaN are never exported: the real tiny model, the real DeepSpeed engine, both AdamW kernels on the CPU."""
from __future__ import annotations

import os

import pytest
import torch

from batchrl.training.trainer.config import TrainerConfig
from batchrl.training.trainer.loop import TrainLoop


def _loop(arith_model: str, tmp_path, fused: bool) -> TrainLoop:
    cfg = TrainerConfig(lr=1e-2, micro_batch_size=1, fused_optimizer=fused, max_length=32)
    return TrainLoop(cfg, model_path=arith_model, out_dir=str(tmp_path / "out"), total_steps=3)


def _one_step(loop: TrainLoop, ids: torch.Tensor, scale: float) -> None:
    loss = loop.model(input_ids=ids).logits.float().pow(2).mean() * scale
    loop.backward(loss)
    loop.accumulate({"loss": loss})
    loop.end_step({}, epoch=0, step_in_epoch=loop.global_step + 1)


def _weights(loop: TrainLoop) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in loop.engine.module.named_parameters()}


def _moments(loop: TrainLoop) -> list[torch.Tensor]:
    return [state["exp_avg"].clone() for state in loop.engine.optimizer.state.values()]


@pytest.mark.parametrize("fused", [False, True], ids=["per_parameter_adamw", "fused_adamw"])
def test_a_nan_step_is_skipped_and_counted(arith_model, tmp_path, fused):
    loop = _loop(arith_model, tmp_path, fused)
    ids = torch.tensor([loop.tokenizer.encode("12 + 30 = 42")])
    _one_step(loop, ids, 1.0)
    before, moments = _weights(loop), _moments(loop)
    _one_step(loop, ids, float("nan"))  # every gradient NaN
    after = _weights(loop)
    assert all(torch.equal(before[n], after[n]) for n in before), "a NaN step moved the weights"
    assert all(torch.equal(a, b) for a, b in zip(moments, _moments(loop))), "a NaN step moved AdamW's moments"
    _one_step(loop, ids, 1.0)  # the next finite step trains again
    assert any(not torch.equal(after[n], p) for n, p in _weights(loop).items())
    summary = loop.summary()
    assert summary["nonfinite_steps"] == 1
    assert [h["skipped_nonfinite"] for h in loop.state["history"]] == [0.0, 1.0, 0.0]
    assert all(torch.isfinite(p).all() for p in loop.engine.module.parameters())
    assert os.path.isdir(loop.export({}))


def test_weights_that_hold_nan_are_not_exported(arith_model, tmp_path):
    loop = _loop(arith_model, tmp_path, fused=False)
    ids = torch.tensor([loop.tokenizer.encode("7 * 6 = 42")])
    _one_step(loop, ids, 1.0)
    with torch.no_grad():  # as an engine that does not skip (DeepSpeed's own bf16 optimiser) would leave them
        next(loop.engine.module.parameters()).view(-1)[0] = float("nan")
    with pytest.raises(FloatingPointError, match="hold NaN or inf after 1 optimiser steps.*nothing is exported"):
        loop.export({})
    assert not os.path.exists(tmp_path / "out" / "model")


def test_a_batch_with_a_nan_advantage_fails_naming_the_row(tmp_path):
    import pandas as pd

    from batchrl.training.trainer.policy import load_batch

    path = str(tmp_path / "batch.parquet")
    pd.DataFrame({"prompt_ids": [[1, 2], [3, 4], [5, 6]], "response_ids": [[7], [8, 9], [10]],
                  "advantages": [[0.5], [0.1, float("nan")], [-0.5]], "reward": [1.0, 0.0, 0.0]}).to_parquet(path)
    with pytest.raises(ValueError, match=r"batch\.parquet: row 1: 'advantages' holds NaN or inf"):
        load_batch(path)
    pd.DataFrame({"prompt_ids": [[1, 2]], "response_ids": [[7]], "advantages": [[0.5]],
                  "reward": [float("inf")]}).to_parquet(path)
    with pytest.raises(ValueError, match="row 0: 'reward' holds NaN or inf"):
        load_batch(path)
