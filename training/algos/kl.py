"""KL estimators, KL as a reward penalty or as a loss, and KL coefficient controllers.

Conventions: verl 0.9.1 ``core_algos.kl_penalty`` / ``apply_kl_penalty`` / KL controllers.
Estimators of KL(pi || pi_ref) from samples of pi, with log_r = logp - logp_ref
(Schulman, "Approximating KL divergence"):
  k1 ("kl"):          log_r                                  unbiased, high variance, can be < 0
  k2 ("mse"):         0.5 * log_r^2                          biased, low variance, >= 0
  k3 ("low_var_kl"):  exp(-log_r) + log_r - 1, clamped to [-10, 10]   unbiased, >= 0
  abs:                |log_r|
A "+" suffix (e.g. "k3+") gives the named estimator's value with k2's gradient (straight-through
unbiased gradient, verl >= 0.5).
"""

from __future__ import annotations

import math

import torch

from .utils import agg_loss, as_float, masked_mean

from .names import KL_ALIASES as _KIND_ALIASES, KL_KINDS  # noqa: F401  (KL_KINDS: every name kl_penalty accepts)


def kl_penalty(logprob, ref_logprob, kind="low_var_kl"):
    """Per-token KL estimate [B, T] (float32 for half inputs); see the module docstring for formulas.

    k3 clamps log(pi_ref/pi) to +-20 before exp and the result to [-10, 10] (verl ``low_var_kl``).
    """
    if kind.endswith("+"):
        value = kl_penalty(logprob, ref_logprob, kind[:-1])
        grad_carrier = kl_penalty(logprob, ref_logprob, "mse")
        return grad_carrier - grad_carrier.detach() + value.detach()
    name = _KIND_ALIASES.get(kind)
    if name is None:
        raise ValueError(f"unknown KL kind {kind!r}; expected one of {sorted(_KIND_ALIASES)}")
    log_ratio = as_float(logprob) - as_float(ref_logprob)
    if name == "kl":
        return log_ratio
    if name == "mse":
        return 0.5 * log_ratio.square()
    if name == "abs":
        return log_ratio.abs()
    ref_minus = torch.clamp(-log_ratio, -20.0, 20.0)
    return torch.clamp(torch.exp(ref_minus) - ref_minus - 1, -10.0, 10.0)


def kl_loss(logprob, ref_logprob, response_mask, *, kind="low_var_kl", loss_agg_mode="token-mean"):
    """KL as a loss term (GRPO-style ``use_kl_loss``): agg(kl_penalty(logp, logp_ref, kind)).
    Multiply by the KL coefficient in the trainer; gradients flow into ``logprob``."""
    return agg_loss(kl_penalty(logprob, ref_logprob, kind), response_mask, loss_agg_mode)


class FixedKLController:
    """Constant KL coefficient: ``value`` never changes."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (kept for a uniform controller interface)."""


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, arXiv:1909.08593; verl/TRL convention).

    e = clip(KL / target - 1, -0.2, 0.2);  beta <- beta * (1 + e * n_steps / horizon)
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if horizon <= 0:
            raise ValueError("horizon must be > 0")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon
        if not math.isfinite(self.value):
            raise FloatingPointError("KL coefficient became non-finite")


def apply_kl_penalty(token_level_scores, old_log_prob, ref_log_prob, response_mask, kl_ctrl, kind="kl"):
    """KL as a reward penalty (verl ``apply_kl_penalty``), and one controller update.

    kld = kl_penalty(logp_old, logp_ref, kind) * m;  r_t = score_t - beta * kld_t, beta = kl_ctrl.value
    current_kl = mean_i(mean_m_t kld_it) (rows without valid tokens excluded);
    then ``kl_ctrl.update(current_kl, n_steps=B)``.
    Returns (token_level_rewards, {"actor/reward_kl_penalty": current_kl,
    "actor/reward_kl_penalty_coeff": beta}) with beta the coefficient that was applied.
    """
    mask = response_mask.bool()
    kld = kl_penalty(old_log_prob, ref_log_prob, kind).detach()
    kld = torch.where(mask, kld, torch.zeros_like(kld))
    beta = kl_ctrl.value
    token_level_rewards = as_float(token_level_scores) - beta * kld
    per_seq = masked_mean(kld, mask, dim=-1)
    current_kl = float(masked_mean(per_seq, mask.any(dim=-1)))
    kl_ctrl.update(current_kl=current_kl, n_steps=token_level_scores.shape[0])
    return token_level_rewards, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
