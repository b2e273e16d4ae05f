"""Packing: a micro-batch's sequences laid end to end in a few rows instead of one row each padded to the longest.

RL batches are ragged: at the real profile's GPU size a micro-batch of 64 rollouts holds answers of ~25 tokens
next to a few that ran to the 96-token limit, so padding every row to ``P + R`` computes ~2x the tokens there are,
and the LM head (a [tokens, V] matmul) ~4x. Packed, each row holds several whole sequences back to back (first fit,
longest first, rows as wide as the longest sequence); position ids restart at 0 for every sequence, and
transformers builds a block-diagonal causal mask from them (``attention_mask=None``: its packed-sequence path, the
same one its padding-free collator uses), so no token attends across a sequence boundary and each sequence's
hidden states equal its padded row's up to float rounding. The LM head then runs on the completion tokens alone,
and their log-probs are put back into the padded ``[B, R]`` layout, so every loss over that layout (token-mean, the
sequence means, Dr. GRPO's padded-length norm) is unchanged. Imports torch, not DeepSpeed.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def first_fit_rows(lengths: Sequence[int], width: int) -> list[list[int]]:
    """Sequence indices grouped into rows of at most ``width`` tokens: first fit, longest first (ties in input
    order), so the same lengths always give the same rows."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda k: -lengths[k]):
        slot = next((r for r, room in enumerate(free) if room >= lengths[i]), None)
        if slot is None:
            rows.append([i])
            free.append(width - lengths[i])
        else:
            rows[slot].append(i)
            free[slot] -= lengths[i]
    return rows


def pack_prompt_completion(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
                           pad_id: int) -> dict[str, torch.Tensor]:
    """The packed counterpart of ``batch_layout.pad_prompt_completion``: ``input_ids`` and ``position_ids`` of
    shape ``[rows, W]`` (W = the longest prompt + completion; a row's tail is padding with positions of its own),
    ``responses`` and ``response_mask`` ``[B, R]`` as the padded layout has them, and for the ``n`` completion
    tokens in row-major ``[B, R]`` order: ``packed_index`` (the flat ``rows * W`` position of the hidden state that
    predicts each) and ``packed_slot`` (its flat position in ``[B, R]``)."""
    p_len = np.fromiter(map(len, prompts), dtype=np.int64, count=len(prompts))
    c_len = np.fromiter(map(len, completions), dtype=np.int64, count=len(completions))
    if len(p_len) and p_len.min() < 1:
        raise ValueError("packing needs a prompt token before every completion (an empty prompt was given)")
    lengths = p_len + c_len
    width, R, B = int(lengths.max()), max(1, int(c_len.max(initial=0))), len(prompts)
    rows = first_fit_rows(lengths.tolist(), width)
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    positions = np.zeros((len(rows), width), dtype=np.int64)
    start = np.zeros(B, dtype=np.int64)  # each sequence's flat offset in rows x W
    for r, members in enumerate(rows):
        col = 0
        for i in members:
            ids[r, col:col + p_len[i]] = prompts[i]
            ids[r, col + p_len[i]:col + lengths[i]] = completions[i]
            positions[r, col:col + lengths[i]] = np.arange(lengths[i])
            start[i] = r * width + col
            col += lengths[i]
        positions[r, col:] = np.arange(width - col)  # the padding: a sequence of its own, never a loss token
    responses = np.full((B, R), pad_id, dtype=np.int64)
    mask = np.arange(R)[None, :] < c_len[:, None]
    row_of, t = np.nonzero(mask)  # row-major: sequence by sequence, token by token
    responses[row_of, t] = np.concatenate([np.asarray(c, dtype=np.int64) for c in completions]) if len(t) else []
    return {"input_ids": torch.from_numpy(ids), "position_ids": torch.from_numpy(positions),
            "responses": torch.from_numpy(responses), "response_mask": torch.from_numpy(mask.astype(np.float32)),
            "packed_index": torch.from_numpy(start[row_of] + p_len[row_of] + t - 1),
            "packed_slot": torch.from_numpy(row_of * R + t)}


def unpack_tokens(values: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-completion-token values ``[n]`` (in ``packed_slot`` order) into the padded ``[B, R]`` layout, 0 on
    padding; differentiable w.r.t. ``values``."""
    B, R = batch["response_mask"].shape
    return values.new_zeros(B * R).index_copy(0, batch["packed_slot"], values).view(B, R)
