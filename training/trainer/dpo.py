"""DPO on the DeepSpeed engine: one plain loop over preference pairs against precomputed
reference log-probs (``reference.py``).

Loss (TRL, ``loss_type="sigmoid"``): ``-log σ(β·[(π_c − ref_c) − (π_r − ref_r)])`` with π, ref the
completion log-probs summed over tokens; the other types come from ``algos.dpo_loss`` by name.
Implicit rewards ``β·(π − ref)``; margin = chosen reward − rejected reward.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import torch

from batchrl.training.algos import dpo_loss, orpo_loss, preference_metrics, simpo_loss
from batchrl.training.data.batch_layout import completion_logprobs, encode_pairs, pair_batch, pair_logprobs, to_device
from batchrl.training.trainer.batching import steps_per_epoch
from batchrl.training.trainer.config import DPOConfig
from batchrl.training.data.transfer import to_device_async
from batchrl.training.trainer.loop import Report, TrainLoop, completed_run, fit_batch


def _pair_logps(model: Any, items: list[dict], pad_id: int, device, fused: bool = True) -> tuple[torch.Tensor, ...]:
    """Summed completion log-probs (chosen, rejected) and token counts for a list of pairs."""
    with torch.profiler.record_function("batchrl/batch"):
        batch = to_device(pair_batch(items, pad_id), device)
    with torch.profiler.record_function("batchrl/forward"):
        logps = completion_logprobs(model, batch, fused=fused).sum(-1)
    lengths = batch["response_mask"].sum(-1)
    n = len(items)
    return logps[:n], logps[n:], lengths[:n], lengths[n:]


def pair_losses(cfg: DPOConfig, pc, pr, ref_c, ref_r, len_c, len_r) -> tuple[torch.Tensor, ...]:
    """(losses, chosen rewards, rejected rewards) of the configured loss: the DPO family against the reference
    log-probs, or a reference-free one (SimPO, ORPO) on the length-normalised policy log-probs."""
    if cfg.loss_type in ("simpo", "orpo"):
        avg_c, avg_r = pc / len_c.clamp_min(1), pr / len_r.clamp_min(1)
        if cfg.loss_type == "simpo":
            return simpo_loss(avg_c, avg_r, beta=cfg.beta, gamma=cfg.simpo_gamma, label_smoothing=cfg.label_smoothing)
        return orpo_loss(avg_c, avg_r, -avg_c, beta=cfg.beta)  # the chosen NLL: minus its mean token log-prob
    return dpo_loss(pc, pr, ref_c, ref_r, beta=cfg.beta, loss_type=cfg.loss_type,
                    label_smoothing=cfg.label_smoothing, chosen_lengths=len_c, rejected_lengths=len_r)


def load_pairs(pairs_parquet: str, reference_parquet: str) -> pd.DataFrame:
    pairs = pd.read_parquet(pairs_parquet)
    if "id" not in pairs.columns:
        pairs = pairs.assign(id=[str(i) for i in range(len(pairs))])
    pairs["id"] = pairs["id"].astype(str)
    ref = pd.read_parquet(reference_parquet)
    ref = ref[[c for c in ("id", "ref_chosen_logp", "ref_rejected_logp", "chosen_len", "rejected_len") if c in ref]]
    ref["id"] = ref["id"].astype(str)
    merged = pairs.merge(ref, on="id", how="inner", validate="one_to_one")
    if len(merged) != len(pairs):
        raise ValueError(f"{len(pairs) - len(merged)} pairs have no reference log-probs")
    return merged


def check_reference_tokens(items: list[dict], frame: pd.DataFrame, reference_parquet: str) -> None:
    """The reference log-probs must be sums over the very completion tokens this run scores: the same
    tokenizer and truncation (``reference_logprobs.max_length`` = ``max_length`` here, for pairs longer
    than either). Otherwise the loss compares sums over different tokens — fail before training."""
    if "chosen_len" not in frame:
        return
    for item, row in zip(items, frame.itertuples(index=False)):
        here, there = (len(item["chosen"]), len(item["rejected"])), (int(row.chosen_len), int(row.rejected_len))
        if here != there:
            raise ValueError(
                f"{reference_parquet}: pair id {item['id']!r}: the reference log-probs cover {there[0]} chosen / "
                f"{there[1]} rejected completion tokens, this run tokenises {here[0]} / {here[1]}: compute the "
                "reference with the same max_length (reference_logprobs' config) and the same base model")


def mean_margin(model: Any, items: list[dict], ref_c: np.ndarray, ref_r: np.ndarray, pad_id: int,
                device, batch_size: int | None = None, fused: bool = True,
                max_tokens: int | None = None) -> dict[str, float]:
    """Mean log-ratio margin ``(π_c − ref_c) − (π_r − ref_r)`` and accuracy (margin > 0) over pairs; the
    policy's log-probs from ``pair_logprobs`` (the reference pass's own function, same batching options)."""
    if not items:
        return {"margin": float("nan"), "accuracy": float("nan")}
    logps = pair_logprobs(model, items, pad_id, device, batch_size=batch_size, max_tokens=max_tokens, fused=fused)
    m = (logps["chosen_logp"] - logps["rejected_logp"]) - (ref_c - ref_r)
    return {"margin": float(m.mean()), "accuracy": float((m > 0).mean())}


def train_dpo(cfg: DPOConfig, *, pairs_parquet: str, reference_parquet: str, model_path: str,
              out_dir: str, report: Report | None = None) -> dict[str, Any]:
    """Train ``model_path`` with DPO; checkpoints in ``out_dir/checkpoints``, HF model in
    ``out_dir/model``. Returns metrics: last step's, margin/accuracy before and after, curve."""
    frame = load_pairs(pairs_parquet, reference_parquet)
    cfg = fit_batch(cfg, len(frame))
    inputs = {"pairs": pairs_parquet, "reference": reference_parquet}
    if (done := completed_run(cfg, model_path=model_path, out_dir=out_dir, inputs=inputs)) is not None:
        return done
    n_steps = steps_per_epoch(len(frame), cfg.micro_batch_size, cfg.grad_accum)
    loop = TrainLoop(cfg, model_path=model_path, out_dir=out_dir, total_steps=cfg.epochs * n_steps,
                     inputs=inputs, report=report)
    tok = loop.tokenizer
    pad_id = tok.pad_token_id
    items = encode_pairs(tok, frame.to_dict("records"), cfg.max_length)
    check_reference_tokens(items, frame, reference_parquet)
    ref_c = frame["ref_chosen_logp"].to_numpy(np.float64, copy=True)
    ref_r = frame["ref_rejected_logp"].to_numpy(np.float64, copy=True)
    ref_c_t = torch.as_tensor(ref_c, dtype=torch.float32)
    ref_r_t = torch.as_tensor(ref_r, dtype=torch.float32)
    if "before" not in loop.state:  # measured once, before any update (kept across resumes)
        with loop.measure_context("margin_before"):
            loop.state["before"] = mean_margin(loop.model, items, ref_c, ref_r, pad_id, loop.device,
                                               fused=cfg.fused_logprobs, max_tokens=cfg.measure_batch_tokens)
    before = loop.state["before"]

    lengths = [len(it["chosen_prompt"]) + max(len(it["chosen"]), len(it["rejected"])) for it in items] \
        if cfg.group_by_length else None
    for micro_batches in loop.steps(len(items), cfg.epochs, lengths):
        for idx in micro_batches:
            with loop.forward_context():
                pc, pr, lc, lr_ = _pair_logps(loop.model, [items[i] for i in idx], pad_id, loop.device,
                                              cfg.fused_logprobs)
                losses, rc, rr = pair_losses(cfg, pc, pr, to_device_async(ref_c_t[idx], loop.device),
                                             to_device_async(ref_r_t[idx], loop.device), lc, lr_)
                loss = losses.mean()
            loop.backward(loss)
            loop.accumulate({"loss": loss, **preference_metrics(rc.detach(), rr.detach()),
                             "logps/chosen": pc.detach().mean(), "logps/rejected": pr.detach().mean()})

    result = loop.summary()
    if not result["stopped_early"]:
        with loop.measure_context("margin_after"):
            after = mean_margin(loop.model, items, ref_c, ref_r, pad_id, loop.device, fused=cfg.fused_logprobs,
                                max_tokens=cfg.measure_batch_tokens)
        result.update(margin_before=before["margin"], margin_after=after["margin"],
                      accuracy_before=before["accuracy"], accuracy_after=after["accuracy"],
                      num_pairs=len(items))
        result["model_dir"] = loop.export({k: v for k, v in result.items() if k != "loss_curve"})
    return loop.complete(result)
