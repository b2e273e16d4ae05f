"""A brief supervised warm start of the tiny default on the task's (prompt, gold answer) pairs.

A randomly initialised model answers nothing right when greedy, and its samples are right only by chance (about
4% on the arithmetic task): GRPO's groups then carry almost no reward variance, and RL has nothing to improve. A
few hundred supervised steps on the training prompts' answers (loss on the answer tokens only, the chat template
the rollouts use) give a base model that is sometimes right: low greedy accuracy, but sampled groups with both
right and wrong answers, which is what a group-relative advantage learns from.
"""
from __future__ import annotations

import random
from typing import Any, Sequence

import torch

from batchrl.training.models.loading import load_model_and_tokenizer


def _encoded(tokenizer: Any, prompt: str, answer: str) -> tuple[list[int], list[int]]:
    """(prompt ids through the chat template with the assistant turn opened, answer ids ending the turn)."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
    return tokenizer(rendered)["input_ids"], tokenizer(answer + tokenizer.eos_token)["input_ids"]


def _batch(pairs: Sequence[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ids, attention mask and labels (-100 on the prompt and the padding)."""
    width = max(len(p) + len(a) for p, a in pairs)
    ids = torch.full((len(pairs), width), pad_id)
    labels = torch.full((len(pairs), width), -100)
    mask = torch.zeros((len(pairs), width), dtype=torch.long)
    for row, (prompt, answer) in enumerate(pairs):
        ids[row, :len(prompt) + len(answer)] = torch.tensor(prompt + answer)
        labels[row, len(prompt):len(prompt) + len(answer)] = torch.tensor(answer)
        mask[row, :len(prompt) + len(answer)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def warm_start(model_dir: str, examples: Sequence[tuple[str, str]], *, steps: int, lr: float = 1e-3,
               batch_size: int = 32, seed: int = 0) -> dict[str, float]:
    """Train the model in ``model_dir`` for ``steps`` AdamW steps on ``examples`` ((prompt, answer) pairs, seeded
    shuffled passes) and save it back in place. Returns ``{"warm_start_steps", "warm_start_loss"}`` (the mean
    loss of the last pass's worth of steps)."""
    torch.manual_seed(seed)
    model, tokenizer = load_model_and_tokenizer(model_dir)
    encoded = [_encoded(tokenizer, prompt, answer) for prompt, answer in examples]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    order, rng, losses = [], random.Random(seed), []
    model.train()
    for _ in range(steps):
        if len(order) < batch_size:
            order += rng.sample(range(len(encoded)), len(encoded))
        chosen, order = order[:batch_size], order[batch_size:]
        loss = model(**_batch([encoded[i] for i in chosen], tokenizer.pad_token_id)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    model.save_pretrained(model_dir, safe_serialization=True)
    last = losses[-max(1, len(encoded) // batch_size):]
    return {"warm_start_steps": steps, "warm_start_loss": sum(last) / len(last) if last else 0.0}
