"""Preference losses (DPO family, TRL 1.x conventions) and the Bradley-Terry reward-model loss.

Inputs are per-example log-probs *summed* over completion tokens, shape [B]. With
    h = (logp_c - logp_r) - (ref_c - ref_r)
each loss is a function of beta * h; rewards are r_c = beta (logp_c - ref_c) and
r_r = beta (logp_r - ref_r), detached (TRL ``DPOTrainer.dpo_loss``).
Half-precision inputs are upcast to float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .utils import as_float


def sigmoid_loss(logits, *, beta, label_smoothing=0.0):
    """DPO (arXiv:2305.18290), cDPO-style smoothing eps (TRL "sigmoid"):
    loss = -(1 - eps) log sigma(beta h) - eps log sigma(-beta h)."""
    return -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing


def robust_loss(logits, *, beta, label_smoothing=0.0):
    """Robust DPO (arXiv:2403.00409, TRL "robust"), unbiased under label-flip rate eps < 0.5:
    loss = (-(1 - eps) log sigma(beta h) + eps log sigma(-beta h)) / (1 - 2 eps)."""
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError("robust DPO needs 0 <= label_smoothing < 0.5")
    return (-F.logsigmoid(beta * logits) * (1 - label_smoothing) + F.logsigmoid(-beta * logits) * label_smoothing) / (
        1 - 2 * label_smoothing
    )


def hinge_loss(logits, *, beta, label_smoothing=0.0):
    """SLiC hinge (arXiv:2305.10425, TRL "hinge"): loss = relu(1 - beta h). Smoothing unused."""
    return torch.relu(1 - beta * logits)


def ipo_loss(logits, *, beta, label_smoothing=0.0):
    """IPO (arXiv:2310.12036 eq. 17, TRL "ipo"): loss = (h - 1 / (2 beta))^2, beta = tau.
    ``logits`` must come from length-normalised (mean per token) log-probs — see ``dpo_loss``."""
    return (logits - 1 / (2 * beta)) ** 2


_LOSS_OF_LOGITS = {"sigmoid": sigmoid_loss, "robust": robust_loss, "hinge": hinge_loss, "ipo": ipo_loss}


def dpo_loss(
    policy_chosen_logps,
    policy_rejected_logps,
    ref_chosen_logps,
    ref_rejected_logps,
    *,
    beta=0.1,
    loss_type="sigmoid",
    label_smoothing=0.0,
    chosen_lengths=None,
    rejected_lengths=None,
):
    """DPO-family loss per example -> (losses [B], chosen_rewards [B], rejected_rewards [B]).

    ``loss_type`` in {"sigmoid", "ipo", "robust", "hinge"} (formulas in the per-type functions).
    For "ipo" every log-prob (policy and reference) is divided by its completion length first,
    as TRL 1.x does, so ``chosen_lengths``/``rejected_lengths`` (valid completion token counts)
    are required; the rewards are then on the per-token scale too. Other types ignore lengths.
    """
    try:
        loss_of_logits = _LOSS_OF_LOGITS[loss_type]
    except KeyError:
        raise ValueError(f"unknown loss_type {loss_type!r}; expected one of {sorted(_LOSS_OF_LOGITS)}") from None
    pc, pr, rc, rr = (as_float(x) for x in (policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps))
    if loss_type == "ipo":
        if chosen_lengths is None or rejected_lengths is None:
            raise ValueError("ipo is length-normalised: pass chosen_lengths and rejected_lengths")
        len_c = torch.as_tensor(chosen_lengths, device=pc.device).to(pc.dtype).clamp_min(1)
        len_r = torch.as_tensor(rejected_lengths, device=pc.device).to(pc.dtype).clamp_min(1)
        pc, rc, pr, rr = pc / len_c, rc / len_c, pr / len_r, rr / len_r
    chosen_logratios = pc - rc
    rejected_logratios = pr - rr
    losses = loss_of_logits(chosen_logratios - rejected_logratios, beta=beta, label_smoothing=label_smoothing)
    return losses, (beta * chosen_logratios).detach(), (beta * rejected_logratios).detach()


def _preference_loss_of_type(loss_type):
    def loss(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, **kwargs):
        return dpo_loss(
            policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, loss_type=loss_type, **kwargs
        )

    loss.__name__ = f"dpo_{loss_type}_loss"
    loss.__doc__ = f"``dpo_loss`` with loss_type={loss_type!r} (same keywords otherwise)."
    return loss


PREFERENCE_LOSSES = {name: _preference_loss_of_type(name) for name in _LOSS_OF_LOGITS}


def get_preference_loss(name):
    """Preference loss by name ("sigmoid", "ipo", "robust", "hinge"); signature of ``dpo_loss``
    without ``loss_type``."""
    try:
        return PREFERENCE_LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown preference loss {name!r}; expected one of {sorted(PREFERENCE_LOSSES)}") from None


def preference_metrics(chosen_rewards, rejected_rewards):
    """TRL-style metrics as python floats: rewards/chosen, rewards/rejected (means),
    rewards/margins = mean(r_c - r_r), rewards/accuracies = mean(r_c > r_r)."""
    chosen, rejected = as_float(chosen_rewards).detach(), as_float(rejected_rewards).detach()
    return {
        "rewards/chosen": float(chosen.mean()),
        "rewards/rejected": float(rejected.mean()),
        "rewards/margins": float((chosen - rejected).mean()),
        "rewards/accuracies": float((chosen > rejected).float().mean()),
    }


def bradley_terry_loss(chosen_scores, rejected_scores, *, margin=None):
    """Bradley-Terry reward-model loss (TRL ``RewardTrainer``):
    loss = mean(-log sigma(s_c - s_r - margin)), margin optional per pair (arXiv:2307.09288).
    Metrics (detached float tensors): accuracy = mean(s_c > s_r), margin = mean(s_c - s_r)."""
    chosen, rejected = as_float(chosen_scores).reshape(-1), as_float(rejected_scores).reshape(-1)
    diff = chosen - rejected
    shifted = diff if margin is None else diff - as_float(torch.as_tensor(margin, device=diff.device)).reshape(-1)
    loss = -F.logsigmoid(shifted).mean()
    metrics = {"accuracy": (diff > 0).to(diff.dtype).mean().detach(), "margin": diff.mean().detach()}
    return loss, metrics
