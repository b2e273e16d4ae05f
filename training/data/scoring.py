"""Scoring many sequences without gradients: one helper, ``score_in_batches``, for every pass that reads a model's
outputs over a table of sequences — the reference log-probs of the DPO pairs and evaluation's margins
(``batch_layout.pair_logprobs``), the policy's old and reference token log-probs
(``batch_layout.sequence_token_logprobs``: the policy update, KTO's reference and KL in the reward), reward-model
scores (``reward_model.score_sequences``) and critic values (``value_model.predict_values``).

The rows go in batches of similar length (little padding: ``length_sorted_batches``); each batch is padded and run
by the caller's function, its result stays on the device, and the host reads every result back once, at the end: a
copy per batch would make the host wait for each forward pass before it pads the next batch (on a GPU, the device
then idles while the host pads). Imports torch, not DeepSpeed: the stages that never train need nothing from
``training/trainer/``.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch


def length_sorted_batches(lengths: Sequence[int], batch_size: int | None = None,
                          max_tokens: int | None = None) -> list[np.ndarray]:
    """Indices in batches of similar length (for passes without gradients; callers restore order): at most
    ``batch_size`` rows, and/or at most ``max_tokens`` padded tokens (rows x the batch's longest; a row
    longer than the budget goes alone)."""
    order = np.argsort(np.asarray(lengths), kind="stable")
    if max_tokens is None:
        return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    batches, start = [], 0
    for k, i in enumerate(order):  # ascending: the row just taken is the batch's longest
        rows = k - start + 1
        if rows > 1 and (rows * lengths[i] > max_tokens or (batch_size is not None and rows > batch_size)):
            batches.append(order[start:k])
            start = k
    if start < len(order):
        batches.append(order[start:])
    return batches


def score_in_batches(model: Any, lengths: Sequence[int], score_batch: Callable[[np.ndarray], torch.Tensor], *,
                     batch_size: int | None = None, max_tokens: int | None = None,
                     by_length: bool = True) -> np.ndarray:
    """``score_batch(idx)`` over every row, in batches, read back into one host array in input order.

    Batches: sorted by ``lengths`` (tokens per row), up to ``batch_size`` rows and/or ``max_tokens`` padded tokens
    (``length_sorted_batches``); ``by_length=False``: consecutive rows in input order, ``batch_size`` at a time.
    ``score_batch`` gets the batch's row indices, pads and runs them, and returns a device tensor whose first
    dimension is the batch's rows (a 2-D one may be as wide as its batch: it is right-padded with 0 to the widest).
    Results stay on the device until every batch is queued, then come back in one copy. ``model`` runs in eval mode
    without gradients (its training flag is restored after). Rows: ``len(lengths)``, at least one."""
    if by_length:
        batches = length_sorted_batches(lengths, batch_size, max_tokens)
    else:
        batches = [np.arange(i, min(i + batch_size, len(lengths))) for i in range(0, len(lengths), batch_size)]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            results = [score_batch(idx) for idx in batches]
    finally:
        model.train(was_training)
    if results[0].dim() > 1:
        width = max(r.shape[1] for r in results)
        results = [torch.nn.functional.pad(r, (0, width - r.shape[1])) if r.shape[1] < width else r for r in results]
    host = torch.cat(results).cpu().numpy()  # the one wait for the device
    out = np.empty_like(host)
    out[np.concatenate(batches)] = host
    return out
