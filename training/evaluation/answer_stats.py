"""How greedy answers end: stopped or cut at the token limit, looping, in the task's answer format.

A small model on GSM8K often repeats a sentence until the budget runs out; accuracy alone hides whether RL
fixed that or just shortened answers, so evaluation reports these beside it.
"""
from __future__ import annotations

from typing import Sequence

LOOP_NGRAM = 16   # a repeated 16-token span is a repeated sentence, not a shared phrase ("the number of")
LOOP_TIMES = 3


def repeats_itself(token_ids: Sequence[int], ngram: int = LOOP_NGRAM, times: int = LOOP_TIMES) -> bool:
    """True iff some ``ngram``-token span occurs ``times`` or more times in ``token_ids`` (overlaps counted)."""
    ids = tuple(token_ids)
    counts: dict[tuple, int] = {}
    for start in range(len(ids) - ngram + 1):
        span = ids[start:start + ngram]
        counts[span] = counts.get(span, 0) + 1
        if counts[span] >= times:
            return True
    return False


def answer_stats(samples: list[dict]) -> dict[str, float]:
    """``truncation_rate`` (cut at the token limit), ``loop_rate`` (``repeats_itself``) and
    ``mean_answer_tokens`` over greedy samples (``finish_reason``, ``response_ids``)."""
    n = max(len(samples), 1)
    return {"truncation_rate": sum(s["finish_reason"] == "length" for s in samples) / n,
            "loop_rate": sum(repeats_itself(s["response_ids"]) for s in samples) / n,
            "mean_answer_tokens": sum(len(s["response_ids"]) for s in samples) / n}
