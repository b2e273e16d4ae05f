"""PPO-family policy losses, the clipped value loss and rollout importance-sampling correction.

Conventions: verl 0.9.1 ``core_algos`` (``compute_policy_loss_vanilla``, ``compute_value_loss``,
rollout correction "TIS"). Inputs in bf16/fp16 are upcast to float32; metrics are detached
0-dim float tensors.
"""

from __future__ import annotations

import torch

from .registry import register_policy_loss
from .utils import agg_loss, as_float, masked_mean, masked_sum

_LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 5e8: keeps ratios finite for wildly off-policy tokens (verl)


@register_policy_loss("vanilla")
def compute_policy_loss(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    *,
    clip_ratio_low=0.2,
    clip_ratio_high=0.2,
    clip_ratio_c=3.0,
    loss_agg_mode="token-mean",
    rollout_is_weights=None,
):
    """PPO clipped surrogate with asymmetric clip and dual-clip (verl ``compute_policy_loss_vanilla``).

    rho = exp(clamp(logp - logp_old, -20, 20))
    L1 = -A rho;  L2 = -A clip(rho, 1 - eps_low, 1 + eps_high);  Lclip = max(L1, L2)
    dual clip (arXiv:1912.09729), only where A < 0:  L = min(Lclip, -c A), c = clip_ratio_c > 1
    L is multiplied by ``rollout_is_weights`` (if given) and aggregated with ``agg_loss``.

    Metrics: pg_clipfrac = mean_m[L2 > L1]; pg_clipfrac_lower = mean_m[Lclip > -c A and A < 0];
    ppo_kl = mean_m(logp_old - logp) (k1 estimate of KL(old || new)).
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"dual-clip needs clip_ratio_c > 1, got {clip_ratio_c}")
    log_prob, old_log_prob, advantages = as_float(log_prob), as_float(old_log_prob), as_float(advantages)
    log_ratio = torch.clamp(log_prob - old_log_prob, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    ppo_kl = masked_mean(-log_ratio, response_mask)

    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clip_loss = torch.maximum(loss_unclipped, loss_clipped)
    pg_clipfrac = masked_mean(torch.gt(loss_clipped, loss_unclipped).to(clip_loss.dtype), response_mask)

    dual_clip_bound = -advantages * clip_ratio_c
    negative_adv = advantages < 0
    pg_clipfrac_lower = masked_mean(
        (torch.gt(clip_loss, dual_clip_bound) & negative_adv).to(clip_loss.dtype), response_mask
    )
    pg_losses = torch.where(negative_adv, torch.minimum(clip_loss, dual_clip_bound), clip_loss)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * as_float(rollout_is_weights).detach()
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode)
    metrics = {
        "pg_clipfrac": pg_clipfrac.detach(),
        "pg_clipfrac_lower": pg_clipfrac_lower.detach(),
        "ppo_kl": ppo_kl.detach(),
    }
    return loss, metrics


@register_policy_loss("gspo")
def compute_policy_loss_gspo(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    *,
    clip_ratio_low=0.2,
    clip_ratio_high=0.2,
    clip_ratio_c=3.0,
    loss_agg_mode="seq-mean-token-mean",
    rollout_is_weights=None,
):
    """GSPO (arXiv:2507.18071, verl ``compute_policy_loss_gspo``): sequence-level ratio.

    log s_i = mean_m(logp - logp_old) over the sequence; per token the ratio is
    s_it = exp(sg[log s_i] + logp_t - sg[logp_t]) (value s_i, gradient through each token),
    clamped at log 10 for stability; L = max(-A s, -A clip(s, 1 - eps_low, 1 + eps_high)).
    No dual clip (``clip_ratio_c`` accepted for a uniform signature; pg_clipfrac_lower = 0).
    """
    log_prob, old_log_prob, advantages = as_float(log_prob), as_float(old_log_prob), as_float(advantages)
    log_ratio = log_prob - old_log_prob
    tokens = response_mask.to(log_ratio.dtype).sum(-1).clamp_min(1)
    seq_log_ratio = masked_sum(log_ratio, response_mask, dim=-1) / tokens
    token_log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(torch.clamp(token_log_ratio, max=10.0))
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    pg_losses = torch.maximum(loss_unclipped, loss_clipped)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * as_float(rollout_is_weights).detach()
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode)
    metrics = {
        "pg_clipfrac": masked_mean(torch.gt(loss_clipped, loss_unclipped).to(ratio.dtype), response_mask).detach(),
        "pg_clipfrac_lower": torch.zeros((), dtype=ratio.dtype, device=ratio.device),
        "ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
    }
    return loss, metrics


def compute_value_loss(vpreds, values, returns, response_mask, *, cliprange_value=0.5, loss_agg_mode="token-mean"):
    """Clipped value loss (verl ``compute_value_loss``).

    V_clip = clip(V_pred, V_old - eps_v, V_old + eps_v)
    loss   = 0.5 * agg(max((V_pred - R)^2, (V_clip - R)^2))
    vf_clipfrac = mean_m[(V_clip - R)^2 > (V_pred - R)^2].
    """
    vpreds, values, returns = as_float(vpreds), as_float(values), as_float(returns)
    vpred_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    loss_unclipped = (vpreds - returns) ** 2
    loss_clipped = (vpred_clipped - returns) ** 2
    loss = 0.5 * agg_loss(torch.maximum(loss_unclipped, loss_clipped), response_mask, loss_agg_mode)
    clipfrac = masked_mean(torch.gt(loss_clipped, loss_unclipped).to(loss.dtype), response_mask)
    return loss, {"vf_clipfrac": clipfrac.detach()}


@torch.no_grad()
def compute_rollout_is_weights(old_log_prob, rollout_log_prob, response_mask, *, threshold=2.0, level="token"):
    """Truncated importance-sampling weights for rollout/trainer log-prob mismatch (TIS).

    The rollout engine (vLLM, bf16 kernels) samples from pi_rollout, while the trainer's "old"
    policy pi_old differs numerically. With log_r = logp_old - logp_rollout:
      token:     w_t = min(exp(log_r_t), threshold)
      sequence:  w_i = min(exp(sum_m log_r), threshold), broadcast over tokens
      geometric: w_i = min(exp(mean_m log_r), threshold), broadcast over tokens
    log ratios are clamped to +-20 before exp; weights are detached and 0 at masked positions.
    (verl rollout correction with truncation mode; multiply the per-token policy loss by w.)
    """
    if threshold <= 0:
        raise ValueError("threshold must be > 0")
    log_ratio = as_float(old_log_prob) - as_float(rollout_log_prob)
    mask = response_mask.bool()
    log_ratio = torch.where(mask, log_ratio, torch.zeros_like(log_ratio))
    if level == "token":
        per_token = log_ratio
    elif level == "sequence":
        per_token = masked_sum(log_ratio, mask, dim=-1).unsqueeze(-1).expand_as(log_ratio)
    elif level == "geometric":
        tokens = mask.to(log_ratio.dtype).sum(-1).clamp_min(1)
        per_token = (masked_sum(log_ratio, mask, dim=-1) / tokens).unsqueeze(-1).expand_as(log_ratio)
    else:
        raise ValueError(f"unknown level {level!r}; expected token, sequence or geometric")
    weights = torch.exp(torch.clamp(per_token, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)).clamp(max=threshold)
    return weights * mask.to(weights.dtype)
