"""Bradley-Terry reward-model training on the DeepSpeed engine (the same loop, launcher, precision,
ZeRO stages, checkpoints and resume as DPO and the policy update).

The model is ``load_reward_model(base)``: the base model with a fresh scalar head (seeded by ``seed``).
Per micro-batch of pairs, one forward pass scores chosen and rejected responses together; the loss is
``bradley_terry_loss`` = ``-log σ(r_chosen − r_rejected)``. Accuracy and loss over all pairs are measured
before the first and after the last update; the exported folder is an HF sequence classifier.
"""
from __future__ import annotations

from typing import Any

import pandas as pd
import torch

from batchrl.training.models.lora import SEQ_CLS
from batchrl.training.trainer.batching import seeded_rows, steps_per_epoch
from batchrl.training.trainer.config import RewardModelConfig
from batchrl.training.trainer.loop import Report, TrainLoop, completed_run, fit_batch


def load_pairs(pairs_parquet: str, cfg: RewardModelConfig) -> pd.DataFrame:
    pairs = pd.read_parquet(pairs_parquet, columns=["prompt", "chosen", "rejected"])
    if len(pairs) == 0:
        raise ValueError(f"{pairs_parquet}: no preference pairs to train the reward model on")
    return seeded_rows(pairs, cfg.max_pairs, cfg.seed)


def _trainable_reward_model(path: str, *, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    from batchrl.training.rewards.reward_model import load_reward_model

    model, tokenizer = load_reward_model(path, dtype=dtype, device=device)
    model.config.use_cache = False
    return model.train(), tokenizer


def train_reward_model(cfg: RewardModelConfig, *, pairs_parquet: str, model_path: str, out_dir: str,
                       report: Report | None = None) -> dict[str, Any]:
    """Train a Bradley-Terry RM from ``model_path`` on ``pairs_parquet`` (prompt/chosen/rejected);
    checkpoints in ``out_dir/checkpoints``, the HF classifier in ``out_dir/model``."""
    from batchrl.training.algos import bradley_terry_loss
    from batchrl.training.rewards.reward_model import encode_pairs_scored, pair_accuracy, sequence_scores

    pairs = load_pairs(pairs_parquet, cfg)
    cfg = fit_batch(cfg, len(pairs))
    if (done := completed_run(cfg, model_path=model_path, out_dir=out_dir, inputs={"pairs": pairs_parquet})):
        return done
    n_steps = steps_per_epoch(len(pairs), cfg.micro_batch_size, cfg.grad_accum)
    loop = TrainLoop(cfg, model_path=model_path, out_dir=out_dir, total_steps=cfg.epochs * n_steps,
                     inputs={"pairs": pairs_parquet}, report=report, load_model=_trainable_reward_model,
                     task_type=SEQ_CLS)  # with LoRA the new score head is trained in full and saved with the adapter
    pad_id, n = loop.tokenizer.pad_token_id, len(pairs)
    with loop.phase("tokenise"):  # once, for the accuracy passes and every step (no tokenising inside a step)
        sequences = encode_pairs_scored(loop.tokenizer, pairs, cfg.max_length)
    measure = dict(batch_size=2 * cfg.micro_batch_size, max_tokens=cfg.measure_batch_tokens)
    if "before" not in loop.state:  # measured once, before any update (kept across resumes)
        with loop.measure_context("accuracy_before"):
            loop.state["before"] = pair_accuracy(loop.model, pad_id, sequences, **measure)

    # characters as the length proxy (the grouping the trainer has always used: same batches, same results)
    lengths = [len(p) + max(len(c), len(r)) for p, c, r in zip(pairs["prompt"], pairs["chosen"], pairs["rejected"])] \
        if cfg.group_by_length else None
    for micro_batches in loop.steps(len(pairs), cfg.epochs, lengths):
        for idx in micro_batches:
            rows = [sequences[i] for i in idx] + [sequences[n + i] for i in idx]  # chosen, then rejected
            with loop.forward_context():
                scores = sequence_scores(loop.model, rows, pad_id)
                loss, metrics = bradley_terry_loss(scores[: len(idx)], scores[len(idx):])
            loop.backward(loss)
            loop.accumulate({"loss": loss, **metrics})

    result = loop.summary()
    if not result["stopped_early"]:
        with loop.measure_context("accuracy_after"):
            before, after = loop.state["before"], pair_accuracy(loop.model, pad_id, sequences, **measure)
        result.update(num_pairs=len(pairs), train_accuracy_before=before[0], train_loss_before=before[1],
                      train_accuracy_after=after[0], train_loss_after=after[1])
        result["model_dir"] = loop.export({k: v for k, v in result.items() if k != "loss_curve"})
    return loop.complete(result)
