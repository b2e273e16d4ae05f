"""RL core math for batchrl: advantages, PPO/value/KL losses, preference losses, log-probs.

Pure torch (no dagster/deepspeed). Conventions: verl 0.9.1 ``core_algos`` for advantages, PPO
and KL; TRL 1.x for the DPO family. Each function's docstring states its formula and any
divergence from those conventions.
"""

from .advantages import (
    compute_drgrpo_outcome_advantage,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
)
from .kl import KL_KINDS, AdaptiveKLController, FixedKLController, apply_kl_penalty, kl_loss, kl_penalty
from .logprobs import entropy_from_logits, token_logprobs_from_hidden, token_logprobs_from_logits
from .policy_loss import compute_policy_loss, compute_policy_loss_gspo, compute_rollout_is_weights, compute_value_loss
from .preference import (
    PREFERENCE_LOSSES,
    bradley_terry_loss,
    dpo_loss,
    get_preference_loss,
    preference_metrics,
)
from .registry import (ADV_ESTIMATOR_NEEDS, ADV_ESTIMATORS, POLICY_LOSSES, estimator_needs, get_adv_estimator,
                       get_policy_loss, register_adv_estimator, register_policy_loss)
from .utils import LOSS_AGG_MODES, agg_loss, masked_mean, masked_var, masked_whiten

__all__ = [
    "ADV_ESTIMATORS",
    "ADV_ESTIMATOR_NEEDS",
    "KL_KINDS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "PREFERENCE_LOSSES",
    "AdaptiveKLController",
    "FixedKLController",
    "agg_loss",
    "apply_kl_penalty",
    "bradley_terry_loss",
    "compute_drgrpo_outcome_advantage",
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "compute_policy_loss",
    "compute_policy_loss_gspo",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_remax_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_rollout_is_weights",
    "compute_value_loss",
    "dpo_loss",
    "entropy_from_logits",
    "estimator_needs",
    "get_adv_estimator",
    "get_policy_loss",
    "get_preference_loss",
    "kl_loss",
    "kl_penalty",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "preference_metrics",
    "register_adv_estimator",
    "register_policy_loss",
    "token_logprobs_from_hidden",
    "token_logprobs_from_logits",
]
