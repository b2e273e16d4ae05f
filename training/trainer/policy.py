"""PPO/GRPO policy update on a fixed batch of scored rollouts, on the DeepSpeed engine.

Per token (verl ``core_algos``): ρ = exp(logπ − logπ_old), clipped surrogate with dual clip
(``algos.get_policy_loss(cfg.policy_loss)``), plus ``kl_loss_coef · k3(logπ, logπ_ref)`` as a
loss (GRPO's ``use_kl_loss``; 0 where the RL recipe puts the KL in the reward or nowhere), minus
``entropy_coef · H``; aggregated by ``loss_agg_mode``.

``logπ_old`` and ``logπ_ref`` are computed once before the first update and cached in
``out_dir/fixed_logprobs.pt``, so a resumed run uses exactly the same ones as an uninterrupted run. Their time is
reported apart (``phase_s/``): ``fixed_logprobs`` the old policy's pass, ``reference_pass`` the reference's, and
``load_model`` a reference model read for it.
With ``old_logprobs="rollout"`` the rollout engine's log-probs serve as ``logπ_old``; with
"recompute" (default) the trainer's own are used and, when the rows carry rollout log-probs and
``rollout_is_threshold`` is set, the loss is reweighted by truncated IS min(π_old/π_rollout, C).
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np
import pandas as pd
import torch

from batchrl.training.algos import (agg_loss, compute_rollout_is_weights, get_policy_loss,
                                    kl_penalty, masked_mean)
from batchrl.training.data.batch_layout import (completion_logprobs, pad_floats, pad_prompt_completion,
                                           sequence_token_logprobs, to_device)
from batchrl.training.data.batch_layout import check_packing_supported
from batchrl.training.data.packing import pack_prompt_completion
from batchrl.training.trainer import resident_trainer
from batchrl.training.trainer.batching import steps_per_epoch, world
from batchrl.training.trainer.config import PolicyConfig
from batchrl.training.trainer.loop import Report, TrainLoop, completed_run, fit_batch
from batchrl.training.data.transfer import to_device_async

FIXED_LOGPROBS = "fixed_logprobs.pt"


def _row_batch(rows: dict[str, list], idx, pad_id: int, device, packed: bool = False) -> dict[str, torch.Tensor]:
    layout = pack_prompt_completion if packed else pad_prompt_completion
    batch = layout([rows["prompt_ids"][i] for i in idx], [rows["response_ids"][i] for i in idx], pad_id)
    R = batch["responses"].shape[1]
    if "loss_mask" in rows:  # multi-turn trajectories (training/agent): tool observations are not the policy's tokens
        batch["response_mask"] = batch["response_mask"] * pad_floats([rows["loss_mask"][i] for i in idx], R)
    if "advantages" in rows:  # absent when only log-probs are wanted
        batch["advantages"] = pad_floats([rows["advantages"][i] for i in idx], R)
    return to_device(batch, device)


def _same_model(path_a: str, path_b: str) -> bool:
    """Both paths are one model folder (the policy chain's first update trains the reference itself)."""
    try:
        return os.path.samefile(path_a, path_b)
    except OSError:
        return False


def _fixed_logprobs(loop: TrainLoop, cfg: PolicyConfig, rows: dict[str, list],
                    reference_model_path: str | None) -> dict[str, list]:
    """Old-policy and reference log-probs, computed before the first update and cached on disk."""
    path = os.path.join(loop.out_dir, FIXED_LOGPROBS)
    if os.path.exists(path):
        cached = torch.load(path, weights_only=False)
        if cached.get("run_key") == loop.run_key:
            return cached
    pad_id = loop.tokenizer.pad_token_id
    kw = dict(temperature=cfg.temperature, max_tokens=cfg.measure_batch_tokens, packed=cfg.pack_samples)
    fixed: dict[str, Any] = {"run_key": loop.run_key}
    if cfg.old_logprobs == "recompute":
        fixed["old"] = sequence_token_logprobs(loop.model, rows, pad_id, loop.device, **kw)
    else:
        fixed["old"] = [np.asarray(x, dtype=np.float32) for x in rows["rollout_logprobs"]]
    if cfg.kl_loss_coef > 0 and reference_model_path:
        with loop.phase("reference_pass"):  # timed apart from the old policy's pass (a loaded reference: load_model)
            fixed["ref"] = _reference_logprobs(loop, cfg, rows, reference_model_path, fixed["old"], kw)
    tmp = f"{path}.tmp-{os.getpid()}"
    torch.save(fixed, tmp)
    os.replace(tmp, path)
    return fixed


def _reference_logprobs(loop: TrainLoop, cfg: PolicyConfig, rows: dict[str, list], reference_model_path: str,
                        old: list, kw: dict[str, Any]) -> list:
    """The reference's log-probs: the old policy's own where the policy is the reference (the chain's first
    update), the LoRA base's with the adapter off, else a loaded reference model's."""
    pad_id = loop.tokenizer.pad_token_id
    if _same_model(reference_model_path, loop.model_path):  # the chain's first update: the policy is the reference
        return old if cfg.old_logprobs == "recompute" else \
            sequence_token_logprobs(loop.model, rows, pad_id, loop.device, **kw)  # its pass, no second model
    if loop.lora_base is not None and _same_model(reference_model_path, loop.lora_base):
        with loop.engine.module.disable_adapter():  # LoRA: the frozen base is the reference, no second model
            return sequence_token_logprobs(loop.model, rows, pad_id, loop.device, **kw)
    from batchrl.training.models.loading import load_model_and_tokenizer

    ref, _ = load_model_and_tokenizer(reference_model_path, dtype=torch.float32, device=str(loop.device))
    return sequence_token_logprobs(ref, rows, pad_id, loop.device, **kw)  # the model is freed on return


def _policy_loss(cfg: PolicyConfig, policy_loss_fn, rows, fixed, idx, batch, old, logp, entropy, use_is, device):
    """One micro-batch's loss: policy gradient (+ rollout IS weights) + KL to the reference − entropy bonus;
    metrics stay device tensors."""
    mask, R = batch["response_mask"], batch["response_mask"].shape[1]
    is_weights = None
    if use_is:
        rollout = to_device_async(pad_floats([rows["rollout_logprobs"][i] for i in idx], R), device)
        is_weights = compute_rollout_is_weights(old, rollout, mask, threshold=cfg.rollout_is_threshold)
    pg_loss, pg_metrics = policy_loss_fn(
        old, logp, batch["advantages"], mask, clip_ratio_low=cfg.clip_ratio_low,
        clip_ratio_high=cfg.clip_ratio_high, clip_ratio_c=cfg.clip_ratio_c,
        loss_agg_mode=cfg.loss_agg_mode, rollout_is_weights=is_weights)
    loss = pg_loss
    parts = {"pg_loss": pg_loss, **pg_metrics, "entropy": masked_mean(entropy.detach(), mask)}
    if is_weights is not None:
        parts["rollout_is_weight_mean"] = masked_mean(is_weights, mask)
    if "ref" in fixed:
        ref = to_device_async(pad_floats([fixed["ref"][i] for i in idx], R), device)
        kl = agg_loss(kl_penalty(logp, ref, cfg.kl_loss_type), mask, cfg.loss_agg_mode)
        loss = loss + cfg.kl_loss_coef * kl
        parts["kl_loss"] = kl
    if cfg.entropy_coef:
        loss = loss - cfg.entropy_coef * agg_loss(entropy, mask, cfg.loss_agg_mode)
    return loss, parts


def load_batch(batch_parquet: str) -> dict[str, list]:
    table = pd.read_parquet(batch_parquet)
    missing = {"prompt_ids", "response_ids", "advantages"} - set(table.columns)
    if missing:
        raise KeyError(f"{batch_parquet} lacks columns {sorted(missing)}")
    check_finite_columns(table, batch_parquet)
    table = table[table["response_ids"].map(len) > 0].reset_index(drop=True)
    if "rollout_logprobs" in table.columns and not (
            table["rollout_logprobs"].map(len) == table["response_ids"].map(len)).all():
        table = table.drop(columns="rollout_logprobs")  # the engine was built not to report them
    cols = ["prompt_ids", "response_ids", "advantages"] + [
        c for c in ("rollout_logprobs", "reward", "values", "returns", "loss_mask") if c in table.columns]
    return {c: [list(v) if not np.isscalar(v) else v for v in table[c]] for c in cols}


def check_finite_columns(table: pd.DataFrame, path: str) -> None:
    """A batch whose advantages, rewards or returns hold a NaN or an inf fails here, naming the row: one such value
    would make every trained weight NaN in the step that reads it."""
    for column in ("advantages", "reward", "returns"):
        for row, value in zip(table.index, table[column] if column in table.columns else []):
            if not np.isfinite(np.asarray(value, dtype=np.float64)).all():
                raise ValueError(f"{path}: row {row}: {column!r} holds NaN or inf "
                                 f"({np.asarray(value).ravel()[:8].tolist()}); nothing was trained")


def _start_sampling_ahead(loop: TrainLoop, request: dict[str, Any], adapter: str | None = None) -> dict[str, Any]:
    """The next iteration's samples drawn from the trained weights while the main thread exports them (full weights:
    copied from the trainer before the export) or hashes and publishes them (a LoRA adapter: read from its export,
    megabytes, then merged into the engine's base as a load of the published adapter merges it). Not for ZeRO-3
    shards or several ranks: no process holds the whole model."""
    if loop.cfg.zero_stage >= 3 or world()[1] > 1:
        return {"sample_ahead": "off: the trainer does not hold the whole model (ZeRO-3 or several ranks)"}
    from batchrl.training.rollout import ahead, resident

    try:
        return ahead.start(request, module=loop.engine.module) if adapter is None else \
            ahead.start(request, adapter=adapter, base=loop.lora_base)
    except Exception as error:  # an optimisation only: the update is done and its export must go on
        resident.release()  # an engine the failure may have left half-loaded is not kept for the next job
        return {"sample_ahead": f"off: it could not start ({type(error).__name__}: {error}); the next rollouts step "
                                "samples itself"}


def train_policy(cfg: PolicyConfig, *, batch_parquet: str, model_path: str, out_dir: str,
                 reference_model_path: str | None = None, critic_path: str | None = None,
                 report: Report | None = None, sample_ahead: dict[str, Any] | None = None) -> dict[str, Any]:
    """One PPO/GRPO update of ``model_path`` on ``batch_parquet``; checkpoints in
    ``out_dir/checkpoints``, HF model in ``out_dir/model``. Returns last-step metrics + curve.
    With ``cfg.critic`` the critic at ``critic_path`` (default: a fresh one from ``model_path``)
    is then trained on the batch's returns and exported to ``out_dir/critic`` (``trainer.critic``).
    ``sample_ahead``: the next iteration's rollouts request, sampled from the new weights while they are exported
    (``training/rollout/ahead.py``)."""
    rows = load_batch(batch_parquet)
    if cfg.old_logprobs == "rollout" and "rollout_logprobs" not in rows:
        raise ValueError(f"old_logprobs='rollout' but the rollouts in {batch_parquet} carry no sampled-token "
                         "log-probs: set the rollout engine's sampled_logprobs=True (vLLM) or use "
                         "old_logprobs='recompute'")
    n = len(rows["prompt_ids"])
    cfg = fit_batch(cfg, n)
    if (done := completed_run(cfg, model_path=model_path, out_dir=out_dir, inputs={"batch": batch_parquet})):
        return done
    n_steps = steps_per_epoch(n, cfg.micro_batch_size, cfg.grad_accum)
    loop = TrainLoop(cfg, model_path=model_path, out_dir=out_dir, total_steps=cfg.ppo_epochs * n_steps,
                     inputs={"batch": batch_parquet}, report=report, resident_trainer_ok=True)
    pad_id = loop.tokenizer.pad_token_id
    if cfg.pack_samples:
        check_packing_supported(loop.model, loop.device)
    with loop.measure_context("fixed_logprobs"):
        fixed = _fixed_logprobs(loop, cfg, rows, reference_model_path)
    use_is = (cfg.old_logprobs == "recompute" and cfg.rollout_is_threshold is not None
              and "rollout_logprobs" in rows)
    policy_loss_fn = get_policy_loss(cfg.policy_loss)
    lengths = [len(p) + len(r) for p, r in zip(rows["prompt_ids"], rows["response_ids"])] \
        if cfg.group_by_length else None

    for micro_batches in loop.steps(n, cfg.ppo_epochs, lengths):
        for idx in micro_batches:
            batch = _row_batch(rows, idx, pad_id, loop.device, packed=cfg.pack_samples)
            mask, R = batch["response_mask"], batch["response_mask"].shape[1]
            old = to_device_async(pad_floats([fixed["old"][i] for i in idx], R), loop.device)
            with loop.forward_context():
                logp, entropy = completion_logprobs(loop.model, batch, temperature=cfg.temperature,
                                                    with_entropy=True, fused=cfg.fused_logprobs)
                loss, parts = _policy_loss(cfg, policy_loss_fn, rows, fixed, idx, batch, old, logp, entropy,
                                           use_is, loop.device)
            loop.backward(loss)
            loop.accumulate({**parts, "loss": loss})

    result = loop.summary()
    result["num_samples"] = n
    if "reward" in rows:
        result["batch_mean_reward"] = float(np.mean(rows["reward"]))
    if not result["stopped_early"]:
        if sample_ahead is not None and loop.lora_base is None:
            result.update(_start_sampling_ahead(loop, sample_ahead))
        result["model_dir"] = loop.export({k: v for k, v in result.items()
                                           if k != "loss_curve" and not k.startswith("sample_ahead")})
        if sample_ahead is not None and loop.lora_base is not None:
            result.update(_start_sampling_ahead(loop, sample_ahead, adapter=result["model_dir"]))
        if cfg.critic:
            from batchrl.training.trainer.critic import train_critic

            result.update(train_critic(cfg, rows, critic_path=critic_path or model_path, out_dir=out_dir))
    result["trainer_reused"] = loop.trainer_reused
    if cfg.carry_optimizer_state:  # lineage: whether this update continued its parent's AdamW
        result["optimizer_state"] = "new: the trained checkpoint holds no optimiser state" \
            if loop.optimizer_carried_from is None else f"carried from step {loop.optimizer_carried_from}"
        result["optimizer_state_step"] = loop.optimizer_state_step
    result = loop.complete(result)
    resident_trainer.keep(loop, cfg, result)  # for the next iteration's update, when safe (the worker only)
    return result
