"""The critic of PPO with GAE: a value model V(s_t) per response token, trained with the clipped
value loss (``algos.compute_value_loss``) on the batch's GAE returns, in the policy-update job.

A value model is the policy's transformer with a one-output token head
(``AutoModelForTokenClassification``, ``num_labels=1``, no dropout). A new critic starts from the
policy's (or any causal LM's) weights with the head zeroed, so its first predictions are 0 and the
first GAE batch equals the discounted reward-to-go; later iterations load the critic checkpoint the
previous update exported. Alignment (verl's): the value of response token t is read at the
position before it, where the model has seen the prompt and tokens < t.
"""
from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import pandas as pd
import torch

from batchrl.training import lora
from batchrl.training.algos import compute_value_loss
from batchrl.training.trainer.batching import (epoch_order, pad_floats, pad_prompt_completion, step_micro_batches,
                                               to_device)
from batchrl.training.trainer.config import PolicyConfig

CRITIC_DIR = "critic"


def _architectures(path: str) -> list[str]:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f).get("architectures") or []


def is_value_model(path: str) -> bool:
    """Whether ``path`` holds a value model (a token-classification checkpoint) rather than an LM."""
    return any(a.endswith("ForTokenClassification") for a in _architectures(path))


def load_value_model(path: str, *, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """(value model, tokenizer) from a critic checkpoint; from a reward model (sequence classifier,
    one label) its score head becomes the value head, so V(s_t) starts as the RM's score of the
    prefix; from a causal LM the head starts at zero. A LoRA critic (an adapter of ``TOKEN_CLS``): its base as a
    value model with the adapter merged in; another adapter (a policy's, a reward model's): a new critic from
    its base."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    from batchrl.training.tiny_model import load_tokenizer

    if lora.is_adapter_folder(path):
        if lora.read_adapter_config(path).get("task_type") == lora.TOKEN_CLS:
            model = lora.load_merged(path, lambda base: load_value_model(base, device=device, dtype=dtype)[0])
            model.config.use_cache = False
            return model, load_tokenizer(path)
        path = lora.resolve_base(path)

    existing, from_reward_model = is_value_model(path), any(
        a.endswith("ForSequenceClassification") for a in _architectures(path))
    config = AutoConfig.from_pretrained(path, num_labels=1)
    config.classifier_dropout = 0.0  # the head's default 0.1 dropout would make values noisy in training
    model = AutoModelForTokenClassification.from_pretrained(path, config=config, dtype=dtype)
    if not existing:
        with torch.no_grad():
            if not from_reward_model:
                model.score.weight.zero_()
            if model.score.bias is not None:  # a reward model's head has none
                model.score.bias.zero_()
    model.config.use_cache = False
    return model.to(device), load_tokenizer(path)


def value_predictions(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[B, R]`` values of the response tokens (0 on padding), gradients kept."""
    P = batch["input_ids"].shape[1] - batch["responses"].shape[1]
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"], use_cache=False).logits[..., 0].float()
    return logits[:, P - 1:-1] * batch["response_mask"]


@torch.no_grad()
def predict_values(critic_path: str, table: pd.DataFrame, *, batch_size: int = 16,
                   device: str = "cpu") -> list[list[float]]:
    """Per-row values of ``response_ids`` given ``prompt_ids`` under the critic at ``critic_path``."""
    model, tokenizer = load_value_model(critic_path, device=device)
    model.eval()
    prompts, responses = [list(p) for p in table["prompt_ids"]], [list(r) for r in table["response_ids"]]
    out: list[list[float]] = []
    for start in range(0, len(prompts), batch_size):
        chunk = slice(start, start + batch_size)
        batch = to_device(pad_prompt_completion(prompts[chunk], responses[chunk], tokenizer.pad_token_id), device)
        values = value_predictions(model, batch).cpu().numpy()
        out += [values[j, :len(r)].tolist() for j, r in enumerate(responses[chunk])]
    return out


def train_critic(cfg: PolicyConfig, rows: dict[str, list], *, critic_path: str, out_dir: str,
                 report=None) -> dict[str, Any]:
    """``cfg.ppo_epochs`` passes of the clipped value loss over ``rows`` (``prompt_ids``,
    ``response_ids``, old ``values``, ``returns``) at ``cfg.critic_lr``; exports the critic to
    ``out_dir/critic`` and returns its loss curve and metrics."""
    from batchrl.training.trainer.checkpoint import export_hf_model, seed_everything
    from batchrl.training.trainer.engine import init_deepspeed, make_optimizer, make_scheduler
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
        model, tokenizer, lora_base = lora.trainable(load_value_model, critic_path, cfg, lora.TOKEN_CLS)
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
