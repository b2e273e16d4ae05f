"""KL to the reference in the reward (verl ``algorithm.use_kl_in_reward``; the RL recipe's ``kl_placement: reward``).

Per response token t: ``r_t <- r_t - beta * kl_t`` with ``kl_t = kl_penalty(logp_old_t, logp_ref_t, kind)``
(``algos.apply_kl_penalty``), before advantages are estimated. ``logp_old`` are the rollout
engine's log-probs of the sampled tokens (unwarped policy, see ``rollout.base``); ``logp_ref`` are
the base model's, computed here. ``beta`` comes from a fixed or adaptive controller
(``algos.FixedKLController`` / ``AdaptiveKLController``); the adaptive one's value after each batch
is recorded in the advantages asset's lineage and the next iteration starts from it.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import torch

from batchrl.training.algos import AdaptiveKLController, FixedKLController, apply_kl_penalty
from batchrl.training.data.batch_layout import pad_floats


def reference_token_logprobs(model_path: str, table: pd.DataFrame, *, batch_size: int = 16,
                             device: str = "cpu") -> list[np.ndarray]:
    """Per-row log-probs of ``response_ids`` given ``prompt_ids`` under the model at ``model_path``."""
    from batchrl.training.models.loading import load_model_and_tokenizer
    from batchrl.training.data.batch_layout import sequence_token_logprobs

    model, tokenizer = load_model_and_tokenizer(model_path, dtype=torch.float32, device=device)
    rows = {"prompt_ids": [list(p) for p in table["prompt_ids"]],
            "response_ids": [list(r) for r in table["response_ids"]]}
    out = sequence_token_logprobs(model, rows, tokenizer.pad_token_id, torch.device(device),
                                  temperature=1.0, batch_size=batch_size)
    del model
    return out


def make_kl_controller(kind: str, kl_in_reward_coef: float, *, target_kl: float = 0.1, horizon: int = 10000):
    """``"fixed"`` -> ``FixedKLController(kl_in_reward_coef)``; ``"adaptive"`` -> ``AdaptiveKLController``
    starting at it."""
    if kind == "fixed":
        return FixedKLController(kl_in_reward_coef)
    if kind == "adaptive":
        return AdaptiveKLController(kl_in_reward_coef, target_kl, horizon)
    raise ValueError(f"kl_ctrl must be 'fixed' or 'adaptive', got {kind!r}")


def fold_kl_into_rewards(token_rewards: torch.Tensor, mask: torch.Tensor, old_logprobs: list, ref_logprobs: list,
                         controller, kind: str = "kl") -> tuple[torch.Tensor, dict[str, Any]]:
    """Token rewards minus ``beta * kl`` and metrics: the mean KL, the beta applied and the
    controller's next value (after its update on this batch)."""
    width = token_rewards.shape[1]
    rewards, metrics = apply_kl_penalty(token_rewards, pad_floats(old_logprobs, width), pad_floats(ref_logprobs, width),
                                        mask, controller, kind)
    return rewards, {"kl_in_reward": metrics["actor/reward_kl_penalty"],
                     "kl_coef_applied": metrics["actor/reward_kl_penalty_coeff"],
                     "kl_coef_next": float(controller.value)}
