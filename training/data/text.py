"""Prompt rendering and prompt+completion encoding shared by rollouts, rewards and trainers.

Every stage renders a prompt the same way (the tokenizer's chat template, generation prompt added),
so log-probs computed by the rollout engine, the reference pass and the trainer line up token for token.
"""
from __future__ import annotations

import json
from typing import Any, Sequence

Messages = str | Sequence[dict] | None  # a conversation before the trained turn: {role, content} dicts or their JSON


def render_prompt(tokenizer: Any, prompt: str, messages: Messages = None) -> str:
    """Render a user prompt with the tokenizer's chat template, ready for the assistant's reply. ``messages``
    (a multi-turn context, the ``prompt_messages`` column of the log contracts) is rendered turn by turn
    instead; without a chat template the plain ``prompt`` text is the prompt."""
    if not getattr(tokenizer, "chat_template", None):
        return prompt
    turns = json.loads(messages) if isinstance(messages, str) else messages
    return tokenizer.apply_chat_template(
        list(turns) if turns else [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)


def prompt_messages(rows: Sequence[dict]) -> list[Messages] | None:
    """The rows' multi-turn contexts (``prompt_messages``), or None when no row has one."""
    messages = [row.get("prompt_messages") for row in rows]
    messages = [m if isinstance(m, (str, list, tuple)) and len(m) else None for m in messages]
    return messages if any(m is not None for m in messages) else None


def encode_prompt_completion(
    tokenizer: Any, prompt: str, completion: str, max_length: int | None = None
) -> tuple[list[int], int]:
    """Token ids of ``render(prompt) + completion + eos`` and the index where the completion starts.

    The completion is truncated first (keeping the prompt) when the total exceeds ``max_length``.
    """
    return encode_prompt_completions(tokenizer, [prompt], [completion], max_length)[0]


def context_texts(prompts: Sequence[str], messages: Sequence[Messages] | None) -> list[str | None]:
    """Per prompt, its multi-turn context as JSON text (None without one): hashable, so a prompt and its
    context can key a cache; the lengths must agree (a context paired with the wrong prompt is a silent bug)."""
    if messages is None:
        return [None] * len(prompts)
    if len(messages) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(messages)} multi-turn contexts")
    return [m if m is None or isinstance(m, str) else json.dumps(list(m), ensure_ascii=False) for m in messages]


def encode_prompts(tokenizer: Any, prompts: list[str], messages: Sequence[Messages] | None = None) -> list[list[int]]:
    """The rendered prompts' ids, one batched tokenizer call; a prompt repeated (rollouts ask each one n times,
    preference pairs share theirs between chosen and rejected) is rendered and encoded once. ``messages``: per
    prompt, its multi-turn context (or None), rendered with the chat template in its place."""
    keys = list(zip(prompts, context_texts(prompts, messages)))
    unique = list(dict.fromkeys(keys))
    encoded = dict(zip(unique, tokenizer([render_prompt(tokenizer, p, m) for p, m in unique],
                                         add_special_tokens=False)["input_ids"])) if unique else {}
    return [encoded[k] for k in keys]


def encode_prompt_completions(tokenizer: Any, prompts: list[str], completions: list[str],
                              max_length: int | None = None,
                              prompt_ids: list[list[int]] | None = None,
                              messages: Sequence[Messages] | None = None) -> list[tuple[list[int], int]]:
    """``encode_prompt_completion`` for many rows, with one batched tokenizer call per side (the
    per-row Python calls dominated the CPU time of a training step on GPUs). ``prompt_ids``: the prompts'
    ids from ``encode_prompts`` when the caller has them already; ``messages``: multi-turn contexts."""
    if not prompts:
        return []
    prompt_rows = encode_prompts(tokenizer, prompts, messages) if prompt_ids is None else prompt_ids
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
