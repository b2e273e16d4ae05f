"""RL core math for batchrl: advantages, PPO/value/KL losses, preference losses, log-probs.

Pure torch (no dagster/deepspeed). Conventions: verl 0.9.1 ``core_algos`` for advantages, PPO
and KL; TRL 1.x for the DPO family. Each function's docstring states its formula and any
divergence from those conventions.

The names below are imported on first use (PEP 562): the registries' names and what estimators need
(``names``, ``registry``) come without torch, so loading the Dagster definitions, which check run
configs against them, does not import torch.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # never executed; code versions (lineage.module_closure reads imports statically) follow
    # every module below from whatever imports this package, as when they were imported eagerly
    from . import advantages, dapo, kl, logprobs, lookup, names, offline, policy_loss, preference, registry, utils  # noqa: F401

_EXPORTS = {
    "advantages": ("compute_drgrpo_outcome_advantage", "compute_gae_advantage_return",
                   "compute_grpo_outcome_advantage", "compute_reinforce_plus_plus_baseline_outcome_advantage",
                   "compute_reinforce_plus_plus_outcome_advantage", "compute_remax_outcome_advantage",
                   "compute_rloo_outcome_advantage"),
    "dapo": ("compute_overlong_penalty", "dynamic_sampling_keep", "overlong_filter_mask"),
    "kl": ("AdaptiveKLController", "FixedKLController", "apply_kl_penalty", "kl_loss", "kl_penalty"),
    "offline": ("awr_weights", "kto_kl_reference_point", "kto_loss", "orpo_loss", "rwr_weights", "simpo_loss",
                "weighted_regression_loss"),
    "logprobs": ("entropy_from_logits", "token_logprobs_from_hidden", "token_logprobs_from_logits"),
    "policy_loss": ("compute_policy_loss", "compute_policy_loss_gspo", "compute_rollout_is_weights",
                    "compute_value_loss"),
    "preference": ("PREFERENCE_LOSSES", "bradley_terry_loss", "dpo_loss", "get_preference_loss",
                   "preference_metrics"),
    "names": ("ADV_ESTIMATOR_NEEDS", "KL_KINDS", "POLICY_LOSS_NAMES"),
    "registry": ("ADV_ESTIMATORS", "POLICY_LOSSES", "estimator_needs", "register_adv_estimator",
                 "register_policy_loss"),
    "lookup": ("get_adv_estimator", "get_policy_loss"),
    "utils": ("LOSS_AGG_MODES", "agg_loss", "masked_mean", "masked_var", "masked_whiten"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
    if name in ("ADV_ESTIMATORS", "POLICY_LOSSES"):
        importlib.import_module(f"{__name__}.lookup")._definitions()  # the full registries, as before
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
