"""PPO policy loss (asymmetric + dual clip), GSPO, value loss, rollout IS weights."""

import math

import pytest
import torch

from batchrl.training.algos import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    compute_policy_loss,
    compute_rollout_is_weights,
    compute_value_loss,
    get_policy_loss,
)

RATIOS = [0.5, 1.1, 1.5, 5.0, 0.5]
ADVS = [1.0, 1.0, 1.0, -1.0, -1.0]


def hand_case():
    log_prob = torch.log(torch.tensor([RATIOS]))
    return torch.zeros(1, 5), log_prob, torch.tensor([ADVS]), torch.ones(1, 5)


def test_vanilla_hand_values():
    loss, metrics = compute_policy_loss(*hand_case())
    # per token: -0.5 (no clip), -1.1, -1.2 (clipped high), min(5, 3)=3 (dual clip), 0.8 (clipped low)
    assert loss.item() == pytest.approx((-0.5 - 1.1 - 1.2 + 3.0 + 0.8) / 5, rel=1e-6)
    assert metrics["pg_clipfrac"].item() == pytest.approx(2 / 5)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(1 / 5)
    assert metrics["ppo_kl"].item() == pytest.approx(-sum(math.log(r) for r in RATIOS) / 5, rel=1e-6)
    assert set(metrics) == {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"}


def test_asymmetric_clip_high():
    loss, _ = compute_policy_loss(*hand_case(), clip_ratio_high=0.28)
    assert loss.item() == pytest.approx((-0.5 - 1.1 - 1.28 + 3.0 + 0.8) / 5, rel=1e-6)


def test_dual_clip_constant_and_validation():
    loss, _ = compute_policy_loss(*hand_case(), clip_ratio_c=4.5)
    assert loss.item() == pytest.approx((-0.5 - 1.1 - 1.2 + 4.5 + 0.8) / 5, rel=1e-6)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        compute_policy_loss(*hand_case(), clip_ratio_c=1.0)


def test_gradient_zero_on_clipped_tokens():
    old, log_prob, adv, mask = hand_case()
    log_prob.requires_grad_(True)
    compute_policy_loss(old, log_prob, adv, mask)[0].backward()
    # d/dlogp of -A*rho is -A*rho for unclipped tokens, 0 where the clip or dual clip is active
    assert log_prob.grad[0].tolist() == pytest.approx([-0.5 / 5, -1.1 / 5, 0.0, 0.0, 0.0], abs=1e-6)


def test_rollout_is_weights_scale_token_losses():
    old, log_prob, adv, mask = hand_case()
    weights = torch.tensor([[2.0, 1.0, 1.0, 0.5, 1.0]])
    loss, _ = compute_policy_loss(old, log_prob, adv, mask, rollout_is_weights=weights)
    assert loss.item() == pytest.approx((-1.0 - 1.1 - 1.2 + 1.5 + 0.8) / 5, rel=1e-6)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_padding_never_changes_policy_loss(name, mode):
    g = torch.Generator().manual_seed(0)
    old, new, adv = (torch.randn(3, 4, generator=g) for _ in range(3))
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    loss, metrics = get_policy_loss(name)(old, new, adv, mask, loss_agg_mode=mode)
    pad = lambda x, v: torch.cat([torch.where(mask.bool(), x, torch.tensor(v)), torch.full((3, 2), v)], dim=1)
    mask_p = torch.cat([mask, torch.zeros(3, 2, dtype=mask.dtype)], dim=1)
    loss_p, metrics_p = get_policy_loss(name)(pad(old, 50.0), pad(new, -50.0), pad(adv, float("nan")), mask_p,
                                             loss_agg_mode=mode)
    if mode == "seq-mean-token-sum-norm":  # divides by the padded length T unless a constant is fixed
        loss_p = loss_p * 6 / 4
    assert loss_p.item() == pytest.approx(loss.item(), rel=1e-6)
    for key in metrics:
        assert metrics_p[key].item() == pytest.approx(metrics[key].item(), rel=1e-6, abs=1e-7)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_policy_loss_gradcheck_float64(mode):
    g = torch.Generator().manual_seed(1)
    old = torch.randn(3, 4, generator=g, dtype=torch.float64) * 0.3
    log_prob = (old + 0.3 * torch.randn(3, 4, generator=g, dtype=torch.float64)).requires_grad_(True)
    adv = torch.randn(3, 4, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    fn = get_policy_loss("vanilla")
    assert torch.autograd.gradcheck(lambda lp: fn(old, lp, adv, mask, loss_agg_mode=mode)[0], (log_prob,))


def test_bf16_log_probs_give_float32_loss():
    old, log_prob, adv, mask = hand_case()
    loss16, m16 = compute_policy_loss(old.bfloat16(), log_prob.bfloat16(), adv.bfloat16(), mask)
    loss32, _ = compute_policy_loss(old, log_prob.bfloat16().float(), adv, mask)
    assert loss16.dtype == torch.float32 and m16["ppo_kl"].dtype == torch.float32
    assert loss16.item() == pytest.approx(loss32.item(), rel=1e-6)


def test_gspo_uses_sequence_ratio():
    old = torch.zeros(1, 2)
    log_prob = torch.log(torch.tensor([[1.1, 1.3]])).requires_grad_(True)
    seq_ratio = math.sqrt(1.1 * 1.3)  # geometric mean 1.196 < 1 + 0.2: unclipped
    loss, metrics = get_policy_loss("gspo")(old, log_prob, torch.ones(1, 2), torch.ones(1, 2))
    assert loss.item() == pytest.approx(-seq_ratio, rel=1e-6)
    assert metrics["pg_clipfrac"].item() == 0.0
    # stop-gradient surrogate (not the derivative of the value, so no gradcheck): each token gets -A s / T
    loss.backward()
    assert log_prob.grad[0].tolist() == pytest.approx([-seq_ratio / 2] * 2, rel=1e-6)
    with pytest.raises(ValueError, match="unknown policy loss"):
        get_policy_loss("nope")


def test_value_loss_hand_values():
    vpreds = torch.tensor([[1.0, 2.0, 2.0]])
    values = torch.tensor([[0.0, 1.8, 0.0]])
    returns = torch.tensor([[0.5, 3.0, 3.0]])
    loss, metrics = compute_value_loss(vpreds, values, returns, torch.ones(1, 3), cliprange_value=0.5)
    # clipped preds [0.5, 2.0, 0.5]: max sq errors [0.25, 1.0, 6.25]; clipped loss larger only on the last
    assert loss.item() == pytest.approx(0.5 * (0.25 + 1.0 + 6.25) / 3)
    assert metrics["vf_clipfrac"].item() == pytest.approx(1 / 3)


def test_value_loss_gradcheck_and_padding():
    g = torch.Generator().manual_seed(3)
    vpreds = torch.randn(2, 3, generator=g, dtype=torch.float64, requires_grad=True)
    values, returns = torch.randn(2, 3, generator=g, dtype=torch.float64), torch.randn(2, 3, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert torch.autograd.gradcheck(lambda v: compute_value_loss(v, values, returns, mask)[0], (vpreds,))
    nan_returns = torch.where(mask.bool(), returns, torch.tensor(float("nan"), dtype=torch.float64))
    assert compute_value_loss(vpreds, values, nan_returns, mask)[0].item() == pytest.approx(
        compute_value_loss(vpreds, values, returns, mask)[0].item())


def test_rollout_is_weights_token_truncation():
    rollout = torch.log(torch.tensor([[0.1, 0.4, 0.5]]))
    old = torch.log(torch.tensor([[0.3, 0.2, 0.5]]))  # ratios 3, 0.5, 1
    mask = torch.tensor([[1, 1, 0]])
    w = compute_rollout_is_weights(old, rollout, mask, threshold=2.0)
    assert w[0].tolist() == pytest.approx([2.0, 0.5, 0.0])


@pytest.mark.parametrize("level,expected", [("sequence", 1.5), ("geometric", math.sqrt(1.5))])
def test_rollout_is_weights_sequence_levels(level, expected):
    rollout = torch.log(torch.tensor([[0.1, 0.4, 0.9]]))
    old = torch.log(torch.tensor([[0.3, 0.2, 0.1]]))  # ratios 3, 0.5, (masked)
    mask = torch.tensor([[1, 1, 0]])
    w = compute_rollout_is_weights(old.requires_grad_(True), rollout, mask, threshold=5.0, level=level)
    assert w[0].tolist() == pytest.approx([expected, expected, 0.0], rel=1e-6)
    assert not w.requires_grad
    with pytest.raises(ValueError, match="level"):
        compute_rollout_is_weights(old, rollout, mask, level="batch")
