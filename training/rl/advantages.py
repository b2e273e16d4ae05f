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
from batchrl.training.rl.remax import split_baselines

if TYPE_CHECKING:
    import torch

GROUP_COLUMNS = ("group_id", "uid", "prompt_index", "prompt_id", "prompt")
GROUP_ESTIMATORS = tuple(name for name, needs in ADV_ESTIMATOR_NEEDS.items() if "groups" in needs)
ALL_GROUPS_DROPPED = ("keep_batch", "fail")  # what dynamic sampling does when no group has a reward spread
ALL_GROUPS_KEPT_NOTE = ("dynamic_sampling: every group's rewards were identical, so the whole batch was kept "
                        "(when_all_groups_dropped: keep_batch): zero group-relative advantages, the update moves by "
                        "its KL/entropy terms only")


class AdvantageStageSettings(BaseModel):
    """What ``ops.advantages.config`` holds: the estimator's knobs and DAPO's batch shaping. The estimator and the KL
    in the reward are the RL recipe's (``resources.rl_recipe``), joined in ``AdvantageSettings``."""

    model_config = ConfigDict(extra="forbid")

    gamma: float = Field(1.0, ge=0, le=1, description="discount (gae, reinforce_plus_plus)")
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda")
    norm_adv_by_std: bool = Field(True, description="grpo: divide by the group's (unbiased) std + 1e-6; off = "
                                  "Dr. GRPO")
    critic_init: Literal["policy", "reward_model"] = Field(
        "policy", description="gae: where a new critic starts: the policy's weights with a zero value head, or "
        "the reward model (its score head becomes the value head)")
    overlong_filter: bool = Field(False, description="DAPO's overlong filtering: a sample cut at the token limit "
                                  "(finish_reason length) leaves the policy loss (its loss_mask all 0) but still "
                                  "counts in its group's statistics; metadata overlong_filtered")
    dynamic_sampling: bool = Field(False, description="DAPO's dynamic sampling: a group (one prompt's samples) whose "
                                   "rewards are all identical carries no group-relative advantage and leaves the "
                                   "update batch before the estimator (a group of one stays); metadata "
                                   "dynamic_sampling/groups_kept, groups_dropped. Group estimators only")
    when_all_groups_dropped: Literal[ALL_GROUPS_DROPPED] = Field(  # type: ignore[valid-type]
        "keep_batch", description="dynamic_sampling when every group's rewards are identical: keep_batch trains on the "
        "whole batch (zero advantages: the update moves by its KL/entropy terms only; metadata "
        "dynamic_sampling/all_groups_dropped 1), fail stops the advantages step saying so")

    @model_validator(mode="after")
    def _drop_policy_needs_dynamic_sampling(self):
        if self.when_all_groups_dropped != "keep_batch" and not self.dynamic_sampling:
            raise ValueError("when_all_groups_dropped is set but dynamic_sampling is off: set dynamic_sampling: true")
        return self


class AdvantageSettings(AdvantageStageSettings):
    """The advantages job's settings (verl ``algorithm.*``): the stage's knobs with the recipe's estimator and KL in
    the reward (``RLRecipe.advantage_part``)."""

    estimator: Literal[tuple(ADV_ESTIMATOR_NEEDS)] = Field(  # type: ignore[valid-type]
        "grpo", description="the estimator computing the advantages (from rl_recipe.estimator)")
    use_kl_in_reward: bool = Field(False, description="subtract beta * KL(policy || reference) from the token "
                                   "rewards (rl_recipe.kl_placement reward)")
    kl_in_reward_coef: float = Field(0.001, ge=0, description="beta of that KL, the controller's start value unless "
                                     "one is carried over (rl_recipe.kl_in_reward_coef)")
    kl_penalty: Literal[KL_KINDS] = Field(  # type: ignore[valid-type]
        "kl", description="KL estimator per token of the reward's KL (rl_recipe.kl_penalty)")
    kl_ctrl: Literal["fixed", "adaptive"] = Field("fixed", description="how beta moves between iterations "
                                                  "(rl_recipe.kl_ctrl)")
    target_kl: float = Field(0.1, gt=0, description="adaptive controller's target KL (rl_recipe.target_kl)")
    kl_horizon: int = Field(10000, gt=0, description="adaptive controller's horizon (rl_recipe.kl_horizon)")

    @model_validator(mode="after")
    def _kl_switches_agree(self):
        if self.use_kl_in_reward and self.kl_in_reward_coef == 0:
            raise ValueError("use_kl_in_reward: true with kl_in_reward_coef: 0 subtracts nothing; set "
                             "kl_in_reward_coef > 0")
        return self

    @model_validator(mode="after")
    def _dynamic_sampling_needs_groups(self):
        if self.dynamic_sampling and "groups" not in estimator_needs(self.estimator):
            raise ValueError(f"dynamic_sampling drops groups whose rewards are identical, which carry no advantage "
                             f"only under a group estimator ({', '.join(GROUP_ESTIMATORS)}); estimator "
                             f"{self.estimator} has none")
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


def drop_identical_reward_groups(sampled: pd.DataFrame, baselines: np.ndarray | None, reward_column: str,
                                 when_all_dropped: str = "keep_batch") -> tuple[pd.DataFrame, np.ndarray | None, dict]:
    """DAPO's dynamic sampling (``algos.dapo.dynamic_sampling_keep``): the rows (and their baselines) of the
    groups whose rewards differ, with metrics ``dynamic_sampling/*``. When no group's do, ``when_all_dropped``:
    ``keep_batch`` keeps every row (``all_groups_identical`` 1), ``fail`` raises saying so."""
    import torch  # here, not at module level: the definitions load this module without torch

    from batchrl.training.algos.dapo import dynamic_sampling_keep

    groups = pd.Series(group_index(sampled))
    keep = dynamic_sampling_keep(torch.as_tensor(sampled[reward_column].to_numpy(dtype=np.float64)),
                                 groups.to_numpy()).numpy()
    total, varied = groups.nunique(), groups[keep].nunique()
    everything_dropped = total > 0 and varied == 0
    if everything_dropped and when_all_dropped == "fail":
        raise ValueError(f"advantages: dynamic_sampling: all {total} groups have identical rewards within the group "
                         f"(mean reward {sampled[reward_column].mean():.4g}), so no sample carries a group-relative "
                         "advantage: sample more per prompt or other prompts, or set when_all_groups_dropped: "
                         "keep_batch")
    if everything_dropped:  # the whole batch stays: zero advantages, the update moves by KL/entropy only
        keep = np.ones(len(sampled), dtype=bool)
    kept = groups[keep].nunique()
    metrics = {"dynamic_sampling/groups_identical": total - varied, "dynamic_sampling/groups_kept": kept,
               "dynamic_sampling/groups_dropped": total - kept, "dynamic_sampling/samples_dropped": int((~keep).sum()),
               "dynamic_sampling/all_groups_identical": int(everything_dropped)}
    kept_baselines = None if baselines is None else baselines[keep]
    return sampled[keep].reset_index(drop=True), kept_baselines, metrics


def mask_truncated_samples(out: pd.DataFrame, mask: torch.Tensor, lengths: list[int]) -> tuple[pd.DataFrame, dict]:
    """DAPO's overlong filtering (``algos.dapo.overlong_filter_mask``): ``loss_mask`` of every row, all 0 for
    a sample cut at the token limit (``finish_reason`` length), else its response mask (a trajectory's own
    tokens); metrics ``overlong_filtered`` (samples) and ``overlong_filtered_rate``."""
    import torch  # here, not at module level: the definitions load this module without torch

    from batchrl.training.algos.dapo import overlong_filter_mask

    if "finish_reason" not in out.columns:
        raise ValueError("advantages.overlong_filter needs the rollouts' finish_reason column")
    truncated = (out["finish_reason"] == "length").to_numpy()
    filtered = overlong_filter_mask(mask, torch.as_tensor(truncated))
    out["loss_mask"] = [filtered[i, :n].tolist() for i, n in enumerate(lengths)]
    return out, {"overlong_filtered": int(truncated.sum()), "overlong_filtered_rate": float(truncated.mean())}


def compute_advantages(table: pd.DataFrame, estimator: str = "grpo", *, reward_column: str = "reward",
                       kl: dict[str, Any] | None = None, dynamic_sampling: bool = False,
                       when_all_groups_dropped: str = "keep_batch", overlong_filter: bool = False,
                       **kw: Any) -> pd.DataFrame:
    """Return the sampled rows of ``table`` (greedy baseline rows removed) with ``advantages`` and
    ``returns`` (float lists, one per response token); ``out.attrs["metrics"]`` holds batch metrics.

    ``kw`` goes to the estimator (gamma, lam, epsilon, norm_adv_by_std ...). ``kl``, when given:
    ``{"ref_logprobs": [...] per row of table, "controller": ..., "kind": ...}`` (old log-probs are
    the ``rollout_logprobs`` column). Missing inputs of the estimator are errors that say where
    they come from. DAPO's batch shaping: ``dynamic_sampling`` drops the groups of identical rewards
    before the estimator (``drop_identical_reward_groups``), ``overlong_filter`` takes truncated samples
    out of the loss after it (``mask_truncated_samples``)."""
    import torch  # here, not at module level: the definitions load this module without torch

    if kl is not None:
        table = table.assign(_ref_logprobs=list(kl["ref_logprobs"]))
    sampled, baselines = split_baselines(table.reset_index(drop=True), reward_column)
    metrics: dict[str, Any] = {}
    if dynamic_sampling:
        sampled, baselines, metrics = drop_identical_reward_groups(sampled, baselines, reward_column,
                                                                   when_all_groups_dropped)
    out = sampled.copy()
    needs = estimator_needs(estimator)
    if "reward_baselines" in needs and baselines is None:
        raise ValueError(f"advantages.estimator={estimator} needs a greedy baseline per prompt: set the rollouts "
                         "config greedy_baseline: true")
    if "values" in needs and "values" not in out.columns:
        raise ValueError(f"advantages.estimator={estimator} needs critic values: the batch has no 'values' column")
    if len(out) == 0:
        out = out.drop(columns=["_ref_logprobs"], errors="ignore").assign(advantages=[], returns=[])
        out.attrs["metrics"] = metrics
        return out
    rewards, mask = token_level_rewards(out, reward_column)
    if kl is not None:
        from batchrl.training.rewards.kl_in_reward import fold_kl_into_rewards

        rewards, kl_metrics = fold_kl_into_rewards(rewards, mask, list(out["rollout_logprobs"]),
                                                   list(out["_ref_logprobs"]), kl["controller"], kl.get("kind", "kl"))
        metrics.update(kl_metrics)
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
    if overlong_filter:
        out, filter_metrics = mask_truncated_samples(out, mask, lengths)
        metrics.update(filter_metrics)
    out.attrs["metrics"] = metrics
    return out


def advantages_with_models(table: pd.DataFrame, settings: AdvantageSettings, *,
                           reference_model_path: str | None = None, kl_in_reward_coef: float | None = None,
                           critic_path: str | None = None, device: str = "cpu") -> pd.DataFrame:
    """``compute_advantages`` as ``settings`` ask, with what they need from models (the advantages stage's
    work, in one place whether it runs in the Dagster process or as a job on the GPU host): with
    ``use_kl_in_reward`` the reference model's token log-probs and a KL controller starting at ``kl_in_reward_coef``
    (a value carried over from the previous iteration, else ``settings.kl_in_reward_coef``); with ``critic_path`` the
    critic's values."""
    kl = None
    if settings.use_kl_in_reward:
        from batchrl.training.rewards.kl_in_reward import make_kl_controller, reference_token_logprobs

        if reference_model_path is None:
            raise ValueError("use_kl_in_reward needs the reference model (reference_model_path)")
        start = settings.kl_in_reward_coef if kl_in_reward_coef is None else kl_in_reward_coef
        controller = make_kl_controller(settings.kl_ctrl, start,
                                        target_kl=settings.target_kl, horizon=settings.kl_horizon)
        kl = {"ref_logprobs": reference_token_logprobs(reference_model_path, table, device=device),
              "controller": controller, "kind": settings.kl_penalty}
    if critic_path is not None:
        from batchrl.training.models.value_model import predict_values

        table = table.assign(values=predict_values(critic_path, table, device=device))
    return compute_advantages(table, settings.estimator, gamma=settings.gamma, lam=settings.lam,
                              norm_adv_by_std=settings.norm_adv_by_std, kl=kl,
                              dynamic_sampling=settings.dynamic_sampling,
                              when_all_groups_dropped=settings.when_all_groups_dropped,
                              overlong_filter=settings.overlong_filter)
