"""ReMax greedy baselines (Li et al. 2023, arXiv:2310.10505): one greedy response per prompt whose
reward is the baseline of that prompt's sampled responses, ``A_i = r_i - r_greedy(prompt_i)``.

The greedy rows travel with the samples through rollouts and rewards, marked by
``BASELINE_COLUMN`` (``sample_index = -1``), so they are scored by exactly the same reward mix; the
advantages stage takes them out of the batch and turns their rewards into ``reward_baselines``.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

BASELINE_COLUMN = "is_greedy_baseline"


def greedy_engine(resource):
    """A copy of a rollout engine resource that decodes greedily (temperature 0)."""
    return type(resource)(**{**resource.model_dump(), "temperature": 0.0})


def add_greedy_baselines(samples: pd.DataFrame, greedy: pd.DataFrame) -> pd.DataFrame:
    """``samples`` plus the ``greedy`` rows (one per prompt, same ``prompt_index``), marked
    ``BASELINE_COLUMN`` and ``sample_index = -1``; ordered by (prompt_index, sample_index)."""
    if greedy["prompt_index"].duplicated().any():
        raise ValueError("add_greedy_baselines: more than one greedy response for a prompt")
    marked = pd.concat([samples.assign(**{BASELINE_COLUMN: False}),
                        greedy.assign(**{BASELINE_COLUMN: True, "sample_index": -1})], ignore_index=True)
    return marked.sort_values(["prompt_index", "sample_index"], kind="stable").reset_index(drop=True)


def split_baselines(table: pd.DataFrame, reward_column: str = "reward") -> tuple[pd.DataFrame, np.ndarray | None]:
    """(the sampled rows, the reward of each row's greedy baseline) — ``None`` baselines when the
    table has no greedy rows. A prompt whose greedy row is missing is an error."""
    if BASELINE_COLUMN not in table.columns or not table[BASELINE_COLUMN].any():
        return table.drop(columns=[BASELINE_COLUMN], errors="ignore").reset_index(drop=True), None
    is_baseline = table[BASELINE_COLUMN].astype(bool)
    baseline_by_prompt = table[is_baseline].set_index("prompt_index")[reward_column]
    sampled = table[~is_baseline].drop(columns=[BASELINE_COLUMN]).reset_index(drop=True)
    missing = sorted(set(sampled["prompt_index"]) - set(baseline_by_prompt.index))
    if missing:
        raise ValueError(f"greedy baseline missing for prompt_index {missing[:5]}")
    return sampled, sampled["prompt_index"].map(baseline_by_prompt).to_numpy(dtype=np.float64)
