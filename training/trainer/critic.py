"""The critic of PPO with GAE, trained in the policy-update job: the clipped value loss
(``algos.compute_value_loss``) on the batch's GAE returns, on the DeepSpeed engine. The value model itself (loading
it, its values of response tokens) is ``training.value_model``, which the advantages stage reads without the trainer.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from batchrl.training.models import lora
from batchrl.training.algos import compute_value_loss
from batchrl.training.data.batch_layout import pad_floats, pad_prompt_completion, to_device
from batchrl.training.trainer.batching import epoch_order, step_micro_batches
from batchrl.training.trainer.config import PolicyConfig
from batchrl.training.models.value_model import load_value_model, value_predictions

CRITIC_DIR = "critic"


def train_critic(cfg: PolicyConfig, rows: dict[str, list], *, critic_path: str, out_dir: str,
                 report=None) -> dict[str, Any]:
    """``cfg.ppo_epochs`` passes of the clipped value loss over ``rows`` (``prompt_ids``,
    ``response_ids``, old ``values``, ``returns``) at ``cfg.critic_lr``; exports the critic to
    ``out_dir/critic`` and returns its loss curve and metrics."""
    from batchrl.training.trainer.checkpoint import export_hf_model, seed_everything
    from batchrl.training.trainer.engine import frozen_base_placement, init_deepspeed, make_optimizer, make_scheduler
    from batchrl.training.trainer.loop import compute_autocast, fit_batch, forward_module
    from batchrl.training.trainer.batching import steps_per_epoch

    missing = {"values", "returns"} - set(rows)
    if missing:
        raise KeyError(f"critic training needs the batch columns {sorted(missing)} (advantages with a critic)")
    n = len(rows["prompt_ids"])
    ccfg = fit_batch(cfg.model_copy(update={"lr": cfg.critic_lr}), n)
    seed_everything(cfg.seed)
    if lora.enabled(cfg):  # adapters on the frozen base, the value head trained in full (saved with them)
        if lora.is_adapter_folder(critic_path) and lora.read_adapter_config(critic_path).get("task_type") != lora.TOKEN_CLS:
            critic_path = lora.resolve_base(critic_path)  # a policy's adapter: a new critic from its base
        model, tokenizer, lora_base = lora.trainable(load_value_model, critic_path, cfg, lora.TOKEN_CLS,
                                                     frozen_base_placement(cfg))
    else:
        (model, tokenizer), lora_base = load_value_model(critic_path), None
    model.train()
    n_steps = steps_per_epoch(n, ccfg.micro_batch_size, ccfg.grad_accum)
    optimizer = make_optimizer(model, ccfg)
    engine = init_deepspeed(model, ccfg, optimizer, make_scheduler(optimizer, ccfg, ccfg.ppo_epochs * n_steps))
    curve: list[float] = []
    clipfracs: list[float] = []
    for epoch in range(ccfg.ppo_epochs):
        order = epoch_order(n, cfg.seed, epoch)
        for step in range(n_steps):
            step_loss = 0.0
            for idx in step_micro_batches(order, step, ccfg.micro_batch_size, ccfg.grad_accum):
                batch = to_device(pad_prompt_completion([rows["prompt_ids"][i] for i in idx],
                                                        [rows["response_ids"][i] for i in idx],
                                                        tokenizer.pad_token_id), engine.device)
                mask, R = batch["response_mask"], batch["response_mask"].shape[1]
                old = pad_floats([rows["values"][i] for i in idx], R).to(engine.device)
                returns = pad_floats([rows["returns"][i] for i in idx], R).to(engine.device)
                with compute_autocast(ccfg, engine.device):
                    values = value_predictions(forward_module(engine, ccfg), batch)
                loss, metrics = compute_value_loss(values, old, returns, mask, cliprange_value=cfg.cliprange_value,
                                                   loss_agg_mode=cfg.loss_agg_mode)
                engine.backward(loss)
                engine.step()
                step_loss += loss.item() / ccfg.grad_accum
                clipfracs.append(float(metrics["vf_clipfrac"]))
            curve.append(step_loss)
            if report is not None:
                report({"critic_value_loss": step_loss}, len(curve))
    if lora_base is None:
        export_hf_model(engine, tokenizer, os.path.join(out_dir, CRITIC_DIR))
    else:
        lora.save_adapter(engine, os.path.join(out_dir, CRITIC_DIR), lora_base)
    return {"critic_value_loss_curve": curve, "critic_value_loss_first": curve[0], "critic_value_loss_last": curve[-1],
            "critic_vf_clipfrac": float(np.mean(clipfracs)) if clipfracs else 0.0,
            "critic_mean_return": float(np.mean(np.concatenate([np.asarray(r, dtype=np.float64)
                                                                for r in rows["returns"]])))}
