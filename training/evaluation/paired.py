"""How sure a held-out accuracy is, and a gain over a baseline answered on the same questions.

Held-out sets are small (GSM8K test: 1,319 questions, where one evaluation's standard error at ~30% is 1.3 points;
two seeds of one recipe differed by 3 points: bench/RESULTS.md, 2026-12-06), so a number alone misleads.

- ``mean_stderr``: the standard error of a mean of per-question scores, ``s / sqrt(n)`` (sample standard deviation
  ``s``; lm-evaluation-harness's ``acc_stderr`` for 0/1 scores);
- ``paired_gain``: model minus baseline over the same questions, ``d_i = score_i - baseline_i``: the mean of
  ``d``, its standard error ``s_d / sqrt(n)`` (the paired one: the questions both get right or wrong cancel, so it
  is smaller than two unpaired errors combined), a normal 95% interval ``mean +- 1.96 se``, and how many
  questions the model gained (``d > 0``) and lost (``d < 0``) against the baseline.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

Z95 = 1.959964  # the standard normal's two-sided 95% quantile
# each held-out question's score, in the held-out set's order, as an evaluation keeps it per model
# (``training.evaluation.evaluate``, evaluation.json): what a paired comparison lines up
SCORES = "arith_scores"


def mean_stderr(scores: Sequence[float]) -> float:
    """``std(scores, ddof=1) / sqrt(n)``; 0.0 for fewer than two scores."""
    values = np.asarray(scores, dtype=np.float64)
    return float(values.std(ddof=1) / np.sqrt(len(values))) if len(values) > 1 else 0.0


def paired_gain(scores: Sequence[float], baseline: Sequence[float], prefix: str = "arith_gain") -> dict[str, float]:
    """The gain of ``scores`` over ``baseline`` (per-question scores of the same questions, in the same order):
    ``<prefix>``, ``<prefix>_stderr``, ``<prefix>_ci95_low`` / ``_high``, ``<prefix>_questions_won`` / ``_lost``."""
    model, base = np.asarray(scores, dtype=np.float64), np.asarray(baseline, dtype=np.float64)
    if model.shape != base.shape or not len(model):
        raise ValueError(f"paired_gain: {len(model)} scores against {len(base)} baseline scores; a paired "
                         "comparison needs the same questions, at least one")
    diff = model - base
    gain, stderr = float(diff.mean()), mean_stderr(diff)
    return {prefix: gain, f"{prefix}_stderr": stderr, f"{prefix}_ci95_low": gain - Z95 * stderr,
            f"{prefix}_ci95_high": gain + Z95 * stderr, f"{prefix}_questions_won": int((diff > 0).sum()),
            f"{prefix}_questions_lost": int((diff < 0).sum())}
