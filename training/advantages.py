"""Per-token advantages for a table of scored rollouts, via the ``algos`` estimator registry.

Outcome rewards (one float per response) are placed on each response's last token as
``token_level_rewards`` (verl convention); responses are grouped by prompt for the group-relative
estimators (GRPO ``(r − mean_g)/(std_g + ε)`` with unbiased std, RLOO leave-one-out, ...).
Without a critic, GAE runs with zero values (= discounted reward-to-go).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import torch

from batchrl.training.algos import get_adv_estimator

GROUP_COLUMNS = ("group_id", "uid", "prompt_index", "prompt_id", "prompt")


def group_index(table: pd.DataFrame) -> np.ndarray:
    """The group each response belongs to: first of ``GROUP_COLUMNS`` present."""
    for col in GROUP_COLUMNS:
        if col in table.columns:
            return table[col].astype(str).to_numpy()
    raise KeyError(f"advantages need one of the grouping columns {GROUP_COLUMNS}")


def token_level_rewards(table: pd.DataFrame, reward_column: str = "reward") -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, T]`` rewards (outcome on the last response token) and the response mask."""
    lengths = [len(ids) for ids in table["response_ids"]]
    T = max([1, *lengths])
    rewards = torch.zeros(len(table), T, dtype=torch.float32)
    mask = torch.zeros(len(table), T, dtype=torch.float32)
    for i, (n, r) in enumerate(zip(lengths, table[reward_column].astype(float))):
        mask[i, :n] = 1.0
        if n:
            rewards[i, n - 1] = r
    return rewards, mask


def compute_advantages(table: pd.DataFrame, estimator: str = "grpo", *, reward_column: str = "reward",
                       **kw: Any) -> pd.DataFrame:
    """Return a copy of ``table`` with ``advantages`` and ``returns`` (float lists, one per response
    token). ``kw`` goes to the estimator (gamma, lam, epsilon, norm_adv_by_std, values ...)."""
    out = table.reset_index(drop=True).copy()
    if len(out) == 0:
        return out.assign(advantages=[], returns=[])
    rewards, mask = token_level_rewards(out, reward_column)
    adv, ret = get_adv_estimator(estimator)(token_level_rewards=rewards, response_mask=mask,
                                            index=group_index(out), **kw)
    lengths = mask.sum(-1).long().tolist()
    out["advantages"] = [adv[i, :n].tolist() for i, n in enumerate(lengths)]
    out["returns"] = [ret[i, :n].tolist() for i, n in enumerate(lengths)]
    return out
