"""Whole-run checks of the RL assets' run config, before any asset runs.

Each asset's config validates itself (allowed names come from the registries); what one asset's
choice requires from another's is checked here (``RunConfigError``, naming the fields), from
what the estimators registered they need (``algos.registry``): a greedy baseline for ReMax, several
samples per prompt for group estimators, a critic for GAE, and one place for the KL term. `batchrl run`
calls it with the rest of its up-front validation (``runs.run_config.validate_run_config``),
``runs.execute.execute_assets`` (tests) before executing, the ``rollouts`` asset for runs launched from the UI.
"""
from __future__ import annotations

from typing import Iterable

import pydantic

from batchrl.common.run_config_error import RunConfigError
from batchrl.training.advantages import AdvantageSettings
from batchrl.training.algos import estimator_needs
from batchrl.training.rewards import RewardConfig, get_reward_function
from batchrl.training.trainer.config import PolicyConfig


def _config(ops: dict, asset: str, cls: type):
    try:
        return cls(**(ops.get(asset) or {}).get("config", {}))
    except pydantic.ValidationError as err:
        fields = ", ".join(f"ops.{asset}.config.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
        raise RunConfigError(fields) from None


def check_rl_run_config(run_config: dict | None, selection: Iterable[str] | None = None) -> None:
    """Raise ``RunConfigError`` naming the fields of the first impossible combination among the
    selected assets (all when ``selection`` is None)."""
    from batchrl.assets.rl import RolloutConfig

    ops = (run_config or {}).get("ops", {}) or {}
    selected = set(selection) if selection else None

    def chosen(*assets: str) -> bool:
        return selected is None or all(a in selected for a in assets)

    rollouts = _config(ops, "rollouts", RolloutConfig) if chosen("rollouts") else None
    algorithm = _config(ops, "advantages", AdvantageSettings) if chosen("advantages") else None
    policy = _config(ops, "policy_checkpoint", PolicyConfig) if chosen("policy_checkpoint") else None
    if chosen("rewards"):
        rewards = _config(ops, "rewards", RewardConfig)
        for field, spec in [("rule", rewards.rule), *((f"custom.{k}", v) for k, v in rewards.custom.items())]:
            try:
                get_reward_function(spec)
            except (KeyError, TypeError, ImportError, AttributeError) as err:
                raise RunConfigError(f"ops.rewards.config.{field}: {err}") from None
    if algorithm is not None:
        needs = estimator_needs(algorithm.estimator)
        where = f"ops.advantages.config.estimator={algorithm.estimator}"
        if rollouts is not None and "reward_baselines" in needs and not rollouts.greedy_baseline:
            raise RunConfigError(f"{where} needs a greedy baseline per prompt: set ops.rollouts.config.greedy_baseline: "
                                 "true")
        if rollouts is not None and "groups" in needs and rollouts.samples_per_prompt < 2:
            raise RunConfigError(f"{where} compares responses within a prompt's group: "
                                 f"ops.rollouts.config.samples_per_prompt={rollouts.samples_per_prompt} must be >= 2")
        if policy is not None and "values" in needs and not policy.critic:
            raise RunConfigError(f"{where} needs critic values: set ops.policy_checkpoint.config.critic: true "
                                 "(a value model trained with the policy)")
    if algorithm is not None and policy is not None:
        if "adv_estimator" in policy.model_fields_set and policy.adv_estimator != algorithm.estimator:
            raise RunConfigError(f"ops.policy_checkpoint.config.adv_estimator={policy.adv_estimator} differs from "
                                 f"ops.advantages.config.estimator={algorithm.estimator}")
        if policy.use_kl_in_reward and not algorithm.use_kl_in_reward:
            raise RunConfigError("ops.policy_checkpoint.config.use_kl_in_reward: true turns the KL loss off but "
                                 "ops.advantages.config.use_kl_in_reward is false: the KL term would vanish")
        if algorithm.use_kl_in_reward and not policy.use_kl_in_reward and policy.kl_coef > 0:
            raise RunConfigError("ops.advantages.config.use_kl_in_reward: true puts KL in the reward, and "
                                 "ops.policy_checkpoint.config.use_kl_in_reward: false adds it again as a loss: set "
                                 "policy use_kl_in_reward: true (or its kl_coef: 0)")
