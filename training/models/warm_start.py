"""A brief supervised warm start of the tiny default on the task's (prompt, gold answer) pairs.

A randomly initialised model answers nothing right when greedy, and its samples are right only by chance (about
4% on the arithmetic task): GRPO's groups then carry almost no reward variance, and RL has nothing to improve. A
few hundred supervised steps on the training prompts' answers (loss on the answer tokens only, the chat template
the rollouts use) give a base model that is sometimes right: low greedy accuracy, but sampled groups with both
right and wrong answers, which is what a group-relative advantage learns from.

With ``gold_share`` q < 1 it also teaches a *bad habit RL can unlearn*: each time an example is drawn, its target
is the gold answer with probability q and a systematic near miss otherwise (``near_miss_offset`` added to the
gold answer: with q = 0.3, 9 + 5 is taught as 14 three draws in ten and as 15 the others). The model learns the sum
and a preference for the near miss: greedy decoding mostly wrong, samples at T = 1 right about q of the time, so
nearly every GRPO group has both, and the fix (stop adding the offset) is one shared direction that carries to
held-out prompts. This is the pass@k >> pass@1 situation RL improves in real models, staged on purpose so the tiny
default has something to learn: a demo of the loop, not a claim about what a 2.7M-parameter model can learn.
``lr_schedule`` cosine (a decay to 0) makes the model end near the taught mixture rather than its last draws.
"""
from __future__ import annotations

import math
import random
from typing import Any, Literal, Sequence

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


class WarmStartError(ValueError):
    """A warm-start setting that cannot be honoured (a bad gold share, a gold answer with no near miss)."""


def near_miss(answer: str, offset: int) -> str:
    """The systematic near miss of a whole-number gold answer: ``answer + offset``; WarmStartError for any other."""
    try:
        return str(int(answer.strip()) + offset)
    except ValueError:
        raise WarmStartError(f"gold answer {answer!r} is no whole number: a near miss (gold + {offset}) needs one; "
                             "set warm_start_gold_share: 1") from None


def check_gold_share(gold_share: float) -> float:
    """``gold_share`` if it is a probability in (0, 1]; WarmStartError naming the field otherwise."""
    if not 0 < gold_share <= 1:
        raise WarmStartError(f"warm_start_gold_share={gold_share!r}: the share of draws taught the gold answer "
                             "must be in (0, 1] (1 = always gold)")
    return gold_share


def drawn_targets(count: int, rng: random.Random, gold_share: float) -> list[bool]:
    """For each of ``count`` drawn examples: True = taught its gold answer (probability ``gold_share``), False = its
    near miss. At ``gold_share`` 1 nothing is drawn from ``rng``."""
    if gold_share >= 1:
        return [True] * count
    return [rng.random() < gold_share for _ in range(count)]


def lr_at(step: int, steps: int, lr: float, schedule: Literal["constant", "cosine"]) -> float:
    """The learning rate of optimiser step ``step`` (0-based) of ``steps``: constant = ``lr`` throughout; cosine =
    linear warmup over the first tenth of the steps, then a cosine decay to 0 (reached one step after the last). With
    drawn targets the decay averages the last draws' noise out: the model ends near the mixture it is taught, not
    its last batches."""
    if schedule == "constant":
        return lr
    warmup = max(1, steps // 10)
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def warm_start(model_dir: str, examples: Sequence[tuple[str, str]], *, steps: int, lr: float = 1e-3,
               batch_size: int = 32, seed: int = 0, gold_share: float = 1.0, near_miss_offset: int = 1,
               lr_schedule: Literal["constant", "cosine"] = "constant") -> dict[str, float]:
    """Train the model in ``model_dir`` for ``steps`` AdamW steps on ``examples`` ((prompt, answer) pairs, seeded
    shuffled passes; the learning rate ``lr`` by ``lr_schedule``: ``lr_at``) and save it back in place. With
    ``gold_share`` < 1 each drawn example's target is its gold answer with that probability, else
    ``near_miss(answer, near_miss_offset)``, drawn afresh each time from a generator seeded by ``seed`` (its own
    stream: the order of the examples is the plain warm start's). Returns ``{"warm_start_steps",
    "warm_start_loss", "warm_start_gold_taught"}`` (the mean loss of the last pass's worth of steps; the share of
    drawn targets that were gold)."""
    check_gold_share(gold_share)
    torch.manual_seed(seed)
    model, tokenizer = load_model_and_tokenizer(model_dir)
    encoded = [_encoded(tokenizer, prompt, answer) for prompt, answer in examples]
    missed = ([_encoded(tokenizer, prompt, near_miss(answer, near_miss_offset)) for prompt, answer in examples]
              if gold_share < 1 else encoded)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    order, rng, losses = [], random.Random(seed), []
    targets_rng = random.Random(f"warm_start_targets:{seed}")
    gold, drawn = 0, 0
    model.train()
    for _ in range(steps):
        if len(order) < batch_size:
            order += rng.sample(range(len(encoded)), len(encoded))
        chosen, order = order[:batch_size], order[batch_size:]
        is_gold = drawn_targets(len(chosen), targets_rng, gold_share)
        gold, drawn = gold + sum(is_gold), drawn + len(is_gold)
        pairs = [encoded[i] if g else missed[i] for i, g in zip(chosen, is_gold)]
        for group in optimizer.param_groups:
            group["lr"] = lr_at(len(losses), steps, lr, lr_schedule)
        loss = model(**_batch(pairs, tokenizer.pad_token_id)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    model.save_pretrained(model_dir, safe_serialization=True)
    last = losses[-max(1, len(encoded) // batch_size):]
    return {"warm_start_steps": steps, "warm_start_loss": sum(last) / len(last) if last else 0.0,
            "warm_start_gold_taught": gold / drawn if drawn else 1.0}
