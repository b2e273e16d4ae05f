"""Advantage estimators on [B, T] response tensors (verl 0.9.1 ``core_algos`` conventions).

Uniform call: every estimator is keyword-only and swallows unused keywords, so a trainer can do
``get_adv_estimator(name)(token_level_rewards=..., response_mask=..., index=..., values=..., ...)``
and get ``(advantages [B, T], returns [B, T])``, both float32 (float64 if given float64), computed
without grad. Inputs in bf16/fp16 are upcast to float32 first.

Conventions shared by all estimators (divergences from verl noted):
- rewards at masked positions are ignored (verl sums the whole row for outcome estimators);
  together with zeroed masked outputs this makes padding never change a result.
- advantages and returns are 0 at masked positions (verl leaves GAE/ReMax garbage there).
- ``index`` holds group ids (any hashable: prompt-id strings, ints), one per row, any order.
"""

from __future__ import annotations

import torch

from .registry import register_adv_estimator
from .utils import as_float, group_ids, group_mean_std, masked_sum, masked_whiten


def _prepare(token_level_rewards, response_mask):
    rewards = as_float(token_level_rewards)
    mask = response_mask.to(device=rewards.device).bool()
    return torch.where(mask, rewards, torch.zeros_like(rewards)), mask


def _outcome_scores(token_level_rewards, response_mask):
    """Sequence score s_i = sum_t m_it r_it (outcome reward, usually on the last token)."""
    rewards, mask = _prepare(token_level_rewards, response_mask)
    return masked_sum(rewards, mask, dim=-1), mask


def _broadcast(seq_values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return seq_values.unsqueeze(-1) * mask.to(seq_values.dtype)


@register_adv_estimator("gae", needs=("values",))
@torch.no_grad()
def compute_gae_advantage_return(*, token_level_rewards, response_mask, values=None, gamma=1.0, lam=1.0, **unused):
    """Generalised Advantage Estimation with masked carry-through (verl ``compute_gae_advantage_return``).

    Backwards over t, with m_t the mask:
        delta_t   = r_t + gamma * V_next - V_t
        A_t       = delta_t + gamma * lam * A_next          if m_t else A_next   (carried)
        V_next   <- V_t                                      if m_t else V_next   (carried)
    so masked (e.g. observation/padding) tokens are skipped and the bootstrap jumps over them.
    returns = A + V (before whitening); advantages = masked_whiten(A) (unbiased, shift mean).
    Both are zeroed at masked positions.
    """
    if values is None:
        raise ValueError("gae needs values (critic predictions)")
    rewards, mask = _prepare(token_level_rewards, response_mask)
    values = as_float(values).to(rewards.dtype)
    values = torch.where(mask, values, torch.zeros_like(values))
    next_value = torch.zeros_like(rewards[:, 0])
    last_gae = torch.zeros_like(rewards[:, 0])
    advantages = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[-1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        valid = mask[:, t]
        last_gae = torch.where(valid, delta + gamma * lam * last_gae, last_gae)
        next_value = torch.where(valid, values[:, t], next_value)
        advantages[:, t] = last_gae
    maskf = mask.to(rewards.dtype)
    returns = (advantages + values) * maskf
    advantages = masked_whiten(advantages, mask) * maskf
    return advantages, returns


@register_adv_estimator("grpo", needs=("groups",))
@torch.no_grad()
def compute_grpo_outcome_advantage(
    *, token_level_rewards, response_mask, index, epsilon=1e-6, norm_adv_by_std=True, **unused
):
    """GRPO outcome advantage (verl ``compute_grpo_outcome_advantage``).

    A_i = (s_i - mean_g) / (std_g + epsilon) broadcast over the response tokens, where g is the
    group of row i, std is the *unbiased* sample std, and a group of one has mean 0, std 1.
    ``norm_adv_by_std=False`` gives A_i = s_i - mean_g (Dr.GRPO). returns == advantages.
    """
    scores, mask = _outcome_scores(token_level_rewards, response_mask)
    mean, std, _ = group_mean_std(scores, group_ids(index, scores.shape[0], scores.device))
    adv = (scores - mean) / (std + epsilon) if norm_adv_by_std else scores - mean
    adv = _broadcast(adv, mask)
    return adv, adv


@register_adv_estimator("drgrpo", needs=("groups",))
@torch.no_grad()
def compute_drgrpo_outcome_advantage(*, token_level_rewards, response_mask, index, **unused):
    """Dr.GRPO (arXiv:2503.20783): A_i = s_i - mean_g, no std division (verl: GRPO with
    ``norm_adv_by_std_in_grpo=False``). Pair it with ``loss_agg_mode="seq-mean-token-sum-norm"``.
    Any ``norm_adv_by_std`` passed is ignored: the name fixes the formula."""
    return compute_grpo_outcome_advantage(
        token_level_rewards=token_level_rewards, response_mask=response_mask, index=index, norm_adv_by_std=False
    )


@register_adv_estimator("rloo", needs=("groups",))
@torch.no_grad()
def compute_rloo_outcome_advantage(*, token_level_rewards, response_mask, index, **unused):
    """RLOO leave-one-out baseline (arXiv:2402.14740, verl ``compute_rloo_outcome_advantage``).

    For a group of size n > 1: A_i = s_i - (sum_{j in g, j != i} s_j) / (n - 1)
                                    = n / (n - 1) * (s_i - mean_g).
    A group of one has no baseline: A_i = s_i (verl). returns == advantages.
    """
    scores, mask = _outcome_scores(token_level_rewards, response_mask)
    gid = group_ids(index, scores.shape[0], scores.device)
    _, _, counts = group_mean_std(scores, gid)
    group_sum = torch.zeros_like(scores).index_add_(0, gid, scores)[gid]
    baseline = (group_sum - scores) / (counts - 1).clamp_min(1)
    adv = torch.where(counts > 1, scores - baseline, scores)
    adv = _broadcast(adv, mask)
    return adv, adv


@register_adv_estimator("reinforce_plus_plus", needs=())
@torch.no_grad()
def compute_reinforce_plus_plus_outcome_advantage(*, token_level_rewards, response_mask, gamma=1.0, **unused):
    """REINFORCE++ (arXiv:2501.03262, verl ``compute_reinforce_plus_plus_outcome_advantage``).

    Discounted return-to-go G_t = r_t + gamma * G_{t+1}, where the running return is reset after
    a masked position (verl: ``running_return *= mask_t``), then advantages = masked_whiten(G) * m.
    Returns are G (zeroed at masked positions).
    """
    rewards, mask = _prepare(token_level_rewards, response_mask)
    maskf = mask.to(rewards.dtype)
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[-1])):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * maskf[:, t]
    returns = returns * maskf
    advantages = masked_whiten(returns, mask) * maskf
    return advantages, returns


@register_adv_estimator("reinforce_plus_plus_baseline", needs=("groups",))
@torch.no_grad()
def compute_reinforce_plus_plus_baseline_outcome_advantage(*, token_level_rewards, response_mask, index, **unused):
    """REINFORCE++ with group baseline (verl ``..._baseline_outcome_advantage``).

    a_i = s_i - mean_g (group of one: mean 0), broadcast to tokens, then whitened over the whole
    batch's valid tokens: A = masked_whiten(a * m) * m. returns == advantages.
    """
    scores, mask = _outcome_scores(token_level_rewards, response_mask)
    mean, _, _ = group_mean_std(scores, group_ids(index, scores.shape[0], scores.device))
    adv = _broadcast(scores - mean, mask)
    adv = masked_whiten(adv, mask) * mask.to(adv.dtype)
    return adv, adv


@register_adv_estimator("remax", needs=("reward_baselines",))
@torch.no_grad()
def compute_remax_outcome_advantage(*, token_level_rewards, response_mask, reward_baselines=None, **unused):
    """ReMax (arXiv:2310.10505, verl ``compute_remax_outcome_advantage``): greedy-decode baseline.

    returns G_t = sum_{t' >= t} m_t' r_t' (undiscounted reward-to-go);
    A_t = (G_t - b_i) * m_t with b_i the reward of the greedy response to the same prompt.
    """
    if reward_baselines is None:
        raise ValueError("remax needs reward_baselines (scores of the greedy responses), shape [B]")
    rewards, mask = _prepare(token_level_rewards, response_mask)
    maskf = mask.to(rewards.dtype)
    returns = rewards.flip(-1).cumsum(-1).flip(-1) * maskf
    baselines = as_float(torch.as_tensor(reward_baselines)).to(device=rewards.device, dtype=rewards.dtype)
    advantages = (returns - baselines.reshape(-1, 1)) * maskf
    return advantages, returns
