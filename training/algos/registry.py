"""Name -> function registries for advantage estimators and policy losses (config strings)."""

from __future__ import annotations

from .advantages import (
    compute_drgrpo_outcome_advantage,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
)
from .policy_loss import compute_policy_loss, compute_policy_loss_gspo

ADV_ESTIMATORS = {
    "gae": compute_gae_advantage_return,
    "grpo": compute_grpo_outcome_advantage,
    "drgrpo": compute_drgrpo_outcome_advantage,
    "rloo": compute_rloo_outcome_advantage,
    "reinforce_plus_plus": compute_reinforce_plus_plus_outcome_advantage,
    "reinforce_plus_plus_baseline": compute_reinforce_plus_plus_baseline_outcome_advantage,
    "remax": compute_remax_outcome_advantage,
}

POLICY_LOSSES = {"vanilla": compute_policy_loss, "gspo": compute_policy_loss_gspo}


def _lookup(registry: dict, kind: str, name: str):
    try:
        return registry[name]
    except KeyError:
        raise ValueError(f"unknown {kind} {name!r}; expected one of {sorted(registry)}") from None


def get_adv_estimator(name: str):
    """Advantage estimator by name (keys of ``ADV_ESTIMATORS``)."""
    return _lookup(ADV_ESTIMATORS, "advantage estimator", name)


def get_policy_loss(name: str):
    """Policy loss by name (keys of ``POLICY_LOSSES``); all share ``compute_policy_loss``'s signature."""
    return _lookup(POLICY_LOSSES, "policy loss", name)
