"""Prompt rendering and prompt+completion encoding shared by rollouts, rewards and trainers.

Every stage renders a prompt the same way (the tokenizer's chat template, generation prompt added),
so log-probs computed by the rollout engine, the reference pass and the trainer line up token for token.
"""
from __future__ import annotations

from typing import Any


def render_prompt(tokenizer: Any, prompt: str) -> str:
    """Render a user prompt with the tokenizer's chat template, ready for the assistant's reply."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
    return prompt


def encode_prompt_completion(
    tokenizer: Any, prompt: str, completion: str, max_length: int | None = None
) -> tuple[list[int], int]:
    """Token ids of ``render(prompt) + completion + eos`` and the index where the completion starts.

    The completion is truncated first (keeping the prompt) when the total exceeds ``max_length``.
    """
    return encode_prompt_completions(tokenizer, [prompt], [completion], max_length)[0]


def encode_prompts(tokenizer: Any, prompts: list[str]) -> list[list[int]]:
    """The rendered prompts' ids, one batched tokenizer call; a prompt repeated (rollouts ask each one n times,
    preference pairs share theirs between chosen and rejected) is rendered and encoded once."""
    unique = list(dict.fromkeys(prompts))
    encoded = dict(zip(unique, tokenizer([render_prompt(tokenizer, p) for p in unique],
                                         add_special_tokens=False)["input_ids"])) if unique else {}
    return [encoded[p] for p in prompts]


def encode_prompt_completions(tokenizer: Any, prompts: list[str], completions: list[str],
                              max_length: int | None = None,
                              prompt_ids: list[list[int]] | None = None) -> list[tuple[list[int], int]]:
    """``encode_prompt_completion`` for many rows, with one batched tokenizer call per side (the
    per-row Python calls dominated the CPU time of a training step on GPUs). ``prompt_ids``: the prompts'
    ids from ``encode_prompts`` when the caller has them already."""
    if not prompts:
        return []
    prompt_rows = encode_prompts(tokenizer, prompts) if prompt_ids is None else prompt_ids
    completion_rows = tokenizer(list(completions), add_special_tokens=False)["input_ids"]
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    out = []
    for prompt_ids, completion_ids in zip(prompt_rows, completion_rows):
        completion_ids = list(completion_ids) + eos
        if max_length is not None and len(prompt_ids) + len(completion_ids) > max_length:
            keep = max(1, max_length - len(prompt_ids))
            completion_ids = completion_ids[:keep]
            prompt_ids = prompt_ids[: max_length - len(completion_ids)]
        out.append((list(prompt_ids) + completion_ids, len(prompt_ids)))
    return out
