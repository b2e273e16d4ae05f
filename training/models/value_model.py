"""The critic as a model that is read, not trained: loading a value model and its values of response tokens.

A value model is the policy's transformer with a one-output token head (``AutoModelForTokenClassification``,
``num_labels=1``, no dropout). A new critic starts from the policy's (or any causal LM's) weights with the head zeroed,
so its first predictions are 0 and the first GAE batch equals the discounted reward-to-go; later iterations load the
critic checkpoint the previous update exported. Alignment (verl's): the value of response token t is read at the
position before it, where the model has seen the prompt and tokens < t. The advantages stage reads values here
(``predict_values``) without the trainer; the policy-update job trains the critic (``trainer.critic``).
"""
from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import pandas as pd
import torch

from batchrl.training.models import lora
from batchrl.training.data.batch_layout import pad_prompt_completion, to_device
from batchrl.training.data.scoring import score_in_batches


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

    from batchrl.training.models.loading import load_tokenizer

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


def predict_values(critic_path: str, table: pd.DataFrame, *, batch_size: int = 16,
                   device: str = "cpu") -> list[list[float]]:
    """Per-row values of ``response_ids`` given ``prompt_ids`` under the critic at ``critic_path``, ``batch_size``
    rows at a time in table order (``score_in_batches``: read back once)."""
    model, tokenizer = load_value_model(critic_path, device=device)
    prompts, responses = [list(p) for p in table["prompt_ids"]], [list(r) for r in table["response_ids"]]

    def score(idx: np.ndarray) -> torch.Tensor:
        batch = pad_prompt_completion([prompts[i] for i in idx], [responses[i] for i in idx], tokenizer.pad_token_id)
        return value_predictions(model, to_device(batch, device))

    if not prompts:
        return []
    # table order, not sorted by length: batches of other rows would change the values in their last bits
    values = score_in_batches(model, [len(p) + len(r) for p, r in zip(prompts, responses)], score,
                              batch_size=batch_size, by_length=False)
    return [values[i, :len(r)].tolist() for i, r in enumerate(responses)]
