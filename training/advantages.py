"""Per-token advantages for a table of scored rollouts, via the ``algos`` estimator registry.

Outcome rewards (one float per response) are placed on each response's last token as
``token_level_rewards`` (verl convention); responses are grouped by prompt for the group-relative
estimators (GRPO ``(r − mean_g)/(std_g + ε)`` with unbiased std, RLOO leave-one-out, ...). What an
estimator needs beyond rewards comes from the table: critic ``values`` (a per-token list column),
ReMax ``reward_baselines`` (the greedy rows, ``remax.split_baselines``). With ``kl`` the KL to the
reference is subtracted from the token rewards first (``kl_reward.fold_kl_into_rewards``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import pandas as pd
from pydantic import BaseModel, ConfigDict, Field, model_validator

from batchrl.training.algos import ADV_ESTIMATOR_NEEDS, KL_KINDS, estimator_needs, get_adv_estimator
from batchrl.training.remax import split_baselines

if TYPE_CHECKING:
    import torch

GROUP_COLUMNS = ("group_id", "uid", "prompt_index", "prompt_id", "prompt")


class AdvantageSettings(BaseModel):
    """The algorithm stage (verl ``algorithm.*``): the estimator and KL in the reward."""

    model_config = ConfigDict(extra="forbid")

    estimator: Literal[tuple(ADV_ESTIMATOR_NEEDS)] = Field(  # type: ignore[valid-type]
        "grpo", description="advantage estimator (registry name); gae needs a critic, remax greedy baselines")
    gamma: float = Field(1.0, ge=0, le=1, description="discount (gae, reinforce_plus_plus)")
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda")
    norm_adv_by_std: bool = Field(True, description="grpo: divide by the group's (unbiased) std + 1e-6; off = "
                                  "Dr. GRPO")
    critic_init: Literal["policy", "reward_model"] = Field(
        "policy", description="gae: where a new critic starts: the policy's weights with a zero value head, or "
        "the reward model (its score head becomes the value head)")
    use_kl_in_reward: bool = Field(False, description="subtract beta * KL(policy || reference) from the "
                                   "token rewards; the policy update then needs use_kl_in_reward too")
    kl_penalty: Literal[KL_KINDS] = Field("kl", description="KL estimator per token (k1 'kl', k2 'mse', "  # type: ignore[valid-type]
                                          "k3 'low_var_kl', 'abs')")
    kl_ctrl: Literal["fixed", "adaptive"] = Field("fixed", description="how kl_coef moves between iterations: "
                                                  "fixed, or adaptive (steers the KL towards target_kl; its value is "
                                                  "carried over to the next iteration)")
    kl_coef: float = Field(0.001, ge=0, description="beta of the KL in the reward: token rewards become "
                           "r - beta * KL(policy || reference) when use_kl_in_reward (the adaptive controller's start "
                           "value)")
    target_kl: float = Field(0.1, gt=0, description="adaptive controller: KL it steers towards")
    kl_horizon: int = Field(10000, gt=0, description="adaptive controller: horizon in samples")

    @model_validator(mode="after")
    def _kl_switches_agree(self):
        if self.use_kl_in_reward and self.kl_coef == 0:
            raise ValueError("use_kl_in_reward: true with kl_coef: 0 subtracts nothing; set kl_coef > 0")
        return self


def group_index(table: pd.DataFrame) -> np.ndarray:
    """The group each response belongs to: first of ``GROUP_COLUMNS`` present."""
    for col in GROUP_COLUMNS:
        if col in table.columns:
            return table[col].astype(str).to_numpy()
    raise KeyError(f"advantages need one of the grouping columns {GROUP_COLUMNS}")


def token_level_rewards(table: pd.DataFrame, reward_column: str = "reward") -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, T]`` rewards (outcome on the last response token) and the response mask.

    Multi-turn trajectories (``training/agent``) carry ``loss_mask``: 1 on the model's own tokens, 0 on the tool
    observations between its turns. The mask is then ``loss_mask`` (an observation gets no advantage, so the policy
    loss never trains it) and the outcome sits on the last token the model wrote: ``r_{i,t} = R_i`` at
    ``t = max{t : m_{i,t} = 1}``, else 0 — verl's multi-turn ``response_mask`` convention."""
    import torch  # here, not at module level: the definitions load this module without torch

    lengths = [len(ids) for ids in table["response_ids"]]
    T = max([1, *lengths])
    rewards = torch.zeros(len(table), T, dtype=torch.float32)
    mask = torch.zeros(len(table), T, dtype=torch.float32)
    loss_masks = table["loss_mask"] if "loss_mask" in table.columns else [None] * len(table)
    for i, (n, r, own) in enumerate(zip(lengths, table[reward_column].astype(float), loss_masks)):
        if own is None:
            mask[i, :n] = 1.0
        else:
            if len(own) != n:
                raise ValueError(f"row {i}: loss_mask has {len(own)} entries for {n} response tokens")
            mask[i, :n] = torch.as_tensor(np.asarray(own, dtype=np.float32))
        last = int(mask[i, :n].nonzero().max()) if n and mask[i, :n].any() else None
        if last is not None:
            rewards[i, last] = r
    return rewards, mask


def _padded(column: pd.Series, width: int) -> torch.Tensor:
    import torch  # here, not at module level: the definitions load this module without torch

    out = torch.zeros(len(column), width, dtype=torch.float32)
    for i, seq in enumerate(column):
        seq = np.asarray(seq, dtype=np.float32)[:width]
        out[i, :len(seq)] = torch.from_numpy(seq)
    return out


def compute_advantages(table: pd.DataFrame, estimator: str = "grpo", *, reward_column: str = "reward",
                       kl: dict[str, Any] | None = None, **kw: Any) -> pd.DataFrame:
    """Return the sampled rows of ``table`` (greedy baseline rows removed) with ``advantages`` and
    ``returns`` (float lists, one per response token); ``out.attrs["metrics"]`` holds batch metrics.

    ``kw`` goes to the estimator (gamma, lam, epsilon, norm_adv_by_std ...). ``kl``, when given:
    ``{"ref_logprobs": [...] per row of table, "controller": ..., "kind": ...}`` (old log-probs are
    the ``rollout_logprobs`` column). Missing inputs of the estimator are errors that say where
    they come from."""
    import torch  # here, not at module level: the definitions load this module without torch

    if kl is not None:
        table = table.assign(_ref_logprobs=list(kl["ref_logprobs"]))
    sampled, baselines = split_baselines(table.reset_index(drop=True), reward_column)
    out = sampled.copy()
    needs = estimator_needs(estimator)
    if "reward_baselines" in needs and baselines is None:
        raise ValueError(f"advantages.estimator={estimator} needs a greedy baseline per prompt: set the rollouts "
                         "config greedy_baseline: true")
    if "values" in needs and "values" not in out.columns:
        raise ValueError(f"advantages.estimator={estimator} needs critic values: the batch has no 'values' column")
    metrics: dict[str, Any] = {}
    if len(out) == 0:
        out = out.drop(columns=["_ref_logprobs"], errors="ignore").assign(advantages=[], returns=[])
        out.attrs["metrics"] = metrics
        return out
    rewards, mask = token_level_rewards(out, reward_column)
    if kl is not None:
        from batchrl.training.kl_reward import fold_kl_into_rewards

        rewards, metrics = fold_kl_into_rewards(rewards, mask, list(out["rollout_logprobs"]),
                                                list(out["_ref_logprobs"]), kl["controller"], kl.get("kind", "kl"))
        out = out.drop(columns=["_ref_logprobs"])
    extra: dict[str, Any] = {}
    if "values" in out.columns:
        extra["values"] = _padded(out["values"], rewards.shape[1])
    if baselines is not None:
        extra["reward_baselines"] = torch.as_tensor(baselines, dtype=torch.float32)
        metrics["mean_greedy_reward"] = float(np.mean(baselines))
    adv, ret = get_adv_estimator(estimator)(token_level_rewards=rewards, response_mask=mask,
                                            index=group_index(out), **{**kw, **extra})
    lengths = [len(ids) for ids in out["response_ids"]]  # not mask.sum: a trajectory's mask has holes
    out["advantages"] = [adv[i, :n].tolist() for i, n in enumerate(lengths)]
    out["returns"] = [ret[i, :n].tolist() for i, n in enumerate(lengths)]
    out.attrs["metrics"] = metrics
    return out


def advantages_with_models(table: pd.DataFrame, settings: AdvantageSettings, *,
                           reference_model_path: str | None = None, kl_coef: float | None = None,
                           critic_path: str | None = None, device: str = "cpu") -> pd.DataFrame:
    """``compute_advantages`` as ``settings`` ask, with what they need from models (the advantages stage's
    work, in one place whether it runs in the Dagster process or as a job on the GPU host): with
    ``use_kl_in_reward`` the reference model's token log-probs and a KL controller starting at ``kl_coef``
    (a value carried over from the previous iteration, else ``settings.kl_coef``); with ``critic_path`` the
    critic's values."""
    kl = None
    if settings.use_kl_in_reward:
        from batchrl.training.kl_reward import make_kl_controller, reference_token_logprobs

        if reference_model_path is None:
            raise ValueError("use_kl_in_reward needs the reference model (reference_model_path)")
        controller = make_kl_controller(settings.kl_ctrl, settings.kl_coef if kl_coef is None else kl_coef,
                                        target_kl=settings.target_kl, horizon=settings.kl_horizon)
        kl = {"ref_logprobs": reference_token_logprobs(reference_model_path, table, device=device),
              "controller": controller, "kind": settings.kl_penalty}
    if critic_path is not None:
        from batchrl.training.value_model import predict_values

        table = table.assign(values=predict_values(critic_path, table, device=device))
    return compute_advantages(table, settings.estimator, gamma=settings.gamma, lam=settings.lam,
                              norm_adv_by_std=settings.norm_adv_by_std, kl=kl)
