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
    prompt_ids = tokenizer(render_prompt(tokenizer, prompt), add_special_tokens=False)["input_ids"]
    completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
    if tokenizer.eos_token_id is not None:
        completion_ids = completion_ids + [tokenizer.eos_token_id]
    if max_length is not None and len(prompt_ids) + len(completion_ids) > max_length:
        keep = max(1, max_length - len(prompt_ids))
        completion_ids = completion_ids[:keep]
        prompt_ids = prompt_ids[: max_length - len(completion_ids)]
    return prompt_ids + completion_ids, len(prompt_ids)
