"""The trainers' order over a batch: the epoch shuffle, the ranks' shares and the micro-batches of each step.

The batch layout itself (padding, completion log-probs, preference pairs) is ``training.batch_layout``, shared with the
passes that score sequences without training (``training.scoring``).
"""
from __future__ import annotations

import os
from typing import Sequence

import numpy as np
import pandas as pd

# bench/bench_gpu_scale.py imports the layout and the scoring batches from here
from batchrl.training.data.batch_layout import (FUSED_CHUNK_ROWS, completion_logprobs, encode_pairs,  # noqa: F401
                                           fused_lm_head, pair_batch, to_device)
from batchrl.training.data.scoring import length_sorted_batches  # noqa: F401


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """Deterministic shuffle for ``epoch``: a pure function of (seed, epoch), so resume can skip to
    any step without replaying RNG draws."""
    return np.random.default_rng([seed, epoch]).permutation(n)


def seeded_rows(frame: pd.DataFrame, max_rows: int | None, seed: int) -> pd.DataFrame:
    """At most ``max_rows`` rows of ``frame``, a sample seeded by ``seed`` (the same rows on every rank and
    every resume), index reset; all of them when ``max_rows`` is unset or not smaller. The trainers' row caps
    (``max_pairs``, ``max_rows``): smoke-size runs of a large model on CPU train on a handful of rows."""
    if max_rows and len(frame) > max_rows:
        frame = frame.sample(max_rows, random_state=seed)
    return frame.reset_index(drop=True)


def world() -> tuple[int, int]:
    """(rank, world size) of this process, as set by the launcher (1 process when absent)."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def steps_per_epoch(n: int, micro_batch_size: int, grad_accum: int) -> int:
    """Optimiser steps per pass over ``n`` examples; the global batch spans every rank."""
    return max(1, n // (micro_batch_size * grad_accum * world()[1]))


def step_micro_batches(order: np.ndarray, step: int, micro_batch_size: int, grad_accum: int,
                       lengths: Sequence[int] | None = None) -> list[np.ndarray]:
    """This rank's ``grad_accum`` micro-batches of optimiser step ``step``: the global batch
    ``order[step·G : (step+1)·G]`` (G = micro · accum · world) is cut into one contiguous slice
    per rank, so ranks see disjoint data and one process sees the whole batch.

    With ``lengths`` (tokens per example) the global batch is sorted by length and cut into
    micro-batches of similar lengths (less padding), dealt to the ranks in turn (micro-batch k to rank
    k mod N: every rank gets short and long ones). The micro-batches are the same on 1 or N ranks and
    the step sees the same examples (for a per-example mean loss the same update up to rounding)."""
    rank, size = world()
    per_rank = micro_batch_size * grad_accum
    if lengths is not None:
        batch = order[step * per_rank * size:(step + 1) * per_rank * size]
        batch = batch[np.argsort([lengths[i] for i in batch], kind="stable")]
        return [batch[i:i + micro_batch_size] for i in range(0, len(batch), micro_batch_size)][rank::size]
    start = step * per_rank * size + rank * per_rank
    mine = order[start:start + per_rank]
    return [mine[i:i + micro_batch_size] for i in range(0, len(mine), micro_batch_size)]
