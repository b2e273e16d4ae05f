"""Offline objectives beyond DPO: reference-free pair losses (SimPO, ORPO), unpaired feedback (KTO) and
policy optimisation on logged completions with rewards (advantage- / reward-weighted regression).

Conventions: TRL 1.x (``CPOTrainer`` with ``loss_type="simpo"``, ``ORPOTrainer``, ``KTOTrainer``). Inputs are
per-example completion log-probs, shape [B]: *summed* over completion tokens for KTO (as TRL), *averaged* per
token for SimPO and ORPO (as TRL: both are length-normalised by definition). Half precision is upcast to fp32.
Each function returns ``(losses [B], chosen_rewards, rejected_rewards)`` or ``(losses, metrics)`` as stated;
rewards and metrics are detached.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .registry import register_policy_loss
from .utils import agg_loss, as_float, masked_mean


def simpo_loss(chosen_avg_logps, rejected_avg_logps, *, beta=2.0, gamma=0.5, label_smoothing=0.0):
    """SimPO (arXiv:2405.14734; TRL ``CPOTrainer`` loss_type="simpo", cpo_alpha=0), reference-free:

        h = (avg logp_c - avg logp_r) - gamma / beta
        loss = -(1 - eps) log sigma(beta h) - eps log sigma(-beta h)

    with avg logp the mean completion-token log-prob; rewards r = beta * avg logp (the implicit reward).
    Assumes no reference model: the margin gamma replaces it, so beta is larger than DPO's (2.0-2.5)."""
    pc, pr = as_float(chosen_avg_logps), as_float(rejected_avg_logps)
    logits = (pc - pr) - gamma / beta
    losses = -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing
    return losses, (beta * pc).detach(), (beta * pr).detach()


def orpo_loss(chosen_avg_logps, rejected_avg_logps, chosen_nll, *, beta=0.1):
    """ORPO (arXiv:2403.07691; TRL ``ORPOTrainer``), reference-free: SFT on the chosen completion plus an
    odds-ratio penalty, with p = exp(avg logp) the per-token geometric-mean likelihood:

        log_odds = (avg logp_c - avg logp_r) - (log(1 - p_c) - log(1 - p_r))
        loss = nll_c - beta * log sigma(log_odds)          (beta = the paper's lambda)

    ``chosen_nll``: the chosen completion's mean token negative log-likelihood [B]. Rewards r = beta * avg logp.
    Assumes completions the model already ranks sensibly; no reference model."""
    pc, pr = as_float(chosen_avg_logps), as_float(rejected_avg_logps)
    # log(1 - exp(x)) for x < 0, stable near 0 (x is clamped just below 0 so a certain completion stays finite)
    log1m = lambda x: torch.log(-torch.expm1(x.clamp(max=-1e-6)))  # noqa: E731
    log_odds = (pc - pr) - (log1m(pc) - log1m(pr))
    losses = as_float(chosen_nll) - beta * F.logsigmoid(log_odds)
    return losses, (beta * pc).detach(), (beta * pr).detach()


def kto_kl_reference_point(policy_kl_logps, reference_kl_logps):
    """KTO's reference point z0 (TRL ``KTOTrainer``): the batch's KL estimate from *mismatched* pairs (each
    prompt with another example's completion), ``z0 = max(0, mean(logp - ref_logp))``, detached (no gradient
    flows through the reference point)."""
    return (as_float(policy_kl_logps) - as_float(reference_kl_logps)).mean().clamp(min=0).detach()


def kto_loss(policy_logps, reference_logps, desirable, kl_reference_point, *, beta=0.1, desirable_weight=1.0,
             undesirable_weight=1.0):
    """KTO (arXiv:2402.01306; TRL ``KTOTrainer``) on unpaired binary feedback, summed completion log-probs:

        r = logp - ref_logp
        desirable:   loss = w_d * (1 - sigma(beta (r - z0)))
        undesirable: loss = w_u * (1 - sigma(beta (z0 - r)))

    ``desirable``: bool [B] (thumbs up); z0 from ``kto_kl_reference_point``. Returns (losses [B], rewards
    beta * r [B] detached). Assumes a reference model (its log-probs cached like DPO's). With imbalanced
    feedback the paper keeps w_d n_d / (w_u n_u) in [1, 4/3]."""
    ratio = as_float(policy_logps) - as_float(reference_logps)
    up = torch.as_tensor(desirable, device=ratio.device).bool()
    z0 = as_float(torch.as_tensor(kl_reference_point, device=ratio.device))
    losses = torch.where(up, desirable_weight * (1 - torch.sigmoid(beta * (ratio - z0))),
                         undesirable_weight * (1 - torch.sigmoid(beta * (z0 - ratio))))
    return losses, (beta * ratio).detach()


def awr_weights(advantages, *, beta=1.0, max_weight=20.0):
    """Advantage-weighted regression weights (Peng et al. 2019, arXiv:1910.00177): ``w = min(exp(A / beta),
    max_weight)``, detached. A is a per-completion advantage (e.g. reward minus its prompt group's mean)."""
    return torch.exp(as_float(advantages) / beta).clamp(max=max_weight).detach()


def rwr_weights(rewards, group_ids, *, beta=1.0):
    """Reward-weighted regression weights (Peters & Schaal 2007), normalised within each prompt group:
    ``w_i = n_g * softmax_{j in g}(r_j / beta)_i`` (mean weight 1 per group), detached."""
    r = as_float(rewards) / beta
    gid = torch.as_tensor(group_ids, device=r.device).long()
    n_groups = int(gid.max()) + 1 if gid.numel() else 0
    group_max = torch.full((n_groups,), float("-inf"), dtype=r.dtype, device=r.device).scatter_reduce(
        0, gid, r, reduce="amax")
    e = torch.exp(r - group_max[gid])
    sums = torch.zeros(n_groups, dtype=r.dtype, device=r.device).index_add_(0, gid, e)
    counts = torch.zeros(n_groups, dtype=r.dtype, device=r.device).index_add_(0, gid, torch.ones_like(r))
    return (e / sums[gid] * counts[gid]).detach()


def weighted_regression_loss(token_logps, response_mask, weights, *, loss_agg_mode="token-mean"):
    """Weighted maximum likelihood on logged completions (AWR/RWR's policy step):
    ``L_it = -w_i * logp_it`` aggregated with ``agg_loss``. Metrics: the weights' mean and max."""
    w = as_float(weights).reshape(-1, 1)
    loss = agg_loss(-w * as_float(token_logps), response_mask, loss_agg_mode)
    return loss, {"weight_mean": w.mean().detach(), "weight_max": w.max().detach()}


@register_policy_loss("weighted_regression")
def compute_policy_loss_weighted_regression(old_log_prob, log_prob, advantages, response_mask, *,
                                            clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0,
                                            loss_agg_mode="token-mean", rollout_is_weights=None):
    """``weighted_regression_loss`` in the policy-loss signature, for the policy trainer on logged completions:
    the per-token ``advantages`` carry each completion's (constant) AWR/RWR weight, so
    ``L_it = -w_i * logp_it`` (times ``rollout_is_weights`` if given). No ratio and no clipping: the weights
    keep the update near the logged data. ppo_kl = mean_m(logp_old - logp) is reported for comparison."""
    weights = as_float(advantages)
    if rollout_is_weights is not None:
        weights = weights * as_float(rollout_is_weights).detach()
    log_prob = as_float(log_prob)
    loss = agg_loss(-weights.detach() * log_prob, response_mask, loss_agg_mode)
    zero = torch.zeros((), dtype=log_prob.dtype, device=log_prob.device)
    return loss, {"pg_clipfrac": zero, "pg_clipfrac_lower": zero,
                  "ppo_kl": masked_mean(as_float(old_log_prob) - log_prob, response_mask).detach()}
