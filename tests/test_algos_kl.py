"""KL estimators, KL penalty on rewards, KL loss, KL controllers."""

import math

import pytest
import torch

from batchrl.training.algos import AdaptiveKLController, FixedKLController, apply_kl_penalty, kl_penalty
from batchrl.training.algos.kl import kl_loss

LOGP = torch.log(torch.tensor([[0.5, 0.25]]))
REF = torch.log(torch.tensor([[0.25, 0.5]]))  # log ratios +log2, -log2
L2 = math.log(2)


@pytest.mark.parametrize(
    "kinds,expected",
    [
        (("k1", "kl"), [L2, -L2]),
        (("k2", "mse"), [0.5 * L2**2, 0.5 * L2**2]),
        (("k3", "low_var_kl"), [0.5 + L2 - 1, 2.0 - L2 - 1]),  # exp(-r) + r - 1
        (("abs",), [L2, L2]),
    ],
)
def test_kl_estimators_hand_values(kinds, expected):
    for kind in kinds:
        assert kl_penalty(LOGP, REF, kind)[0].tolist() == pytest.approx(expected, rel=1e-6)


def test_default_is_low_var_kl_and_unknown_kind():
    assert torch.equal(kl_penalty(LOGP, REF), kl_penalty(LOGP, REF, "k3"))
    with pytest.raises(ValueError, match="unknown KL kind"):
        kl_penalty(LOGP, REF, "full")


def test_k3_is_clamped_to_ten():
    out = kl_penalty(torch.tensor([[-30.0, 30.0]]), torch.tensor([[0.0, 0.0]]), "k3")
    assert out[0].tolist() == [10.0, 10.0]
    assert torch.isfinite(out).all()


def test_k3_unbiased_estimate_of_true_kl():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(6, generator=g, dtype=torch.float64), 0)
    q = torch.softmax(torch.randn(6, generator=g, dtype=torch.float64), 0)
    true_kl = (p * (p.log() - q.log())).sum()
    samples = torch.multinomial(p, 200_000, replacement=True, generator=g)
    estimate = kl_penalty(p.log()[samples], q.log()[samples], "k3").mean()
    assert estimate.item() == pytest.approx(true_kl.item(), rel=0.03)


def test_straight_through_plus_variant():
    logp = LOGP.clone().requires_grad_(True)
    out = kl_penalty(logp, REF, "k3+")
    assert torch.allclose(out, kl_penalty(LOGP, REF, "k3"))
    out.sum().backward()
    assert logp.grad[0].tolist() == pytest.approx([L2, -L2], rel=1e-6)  # d/dlogp of k2 = log ratio


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "abs"])
def test_kl_loss_gradcheck_and_padding(kind):
    g = torch.Generator().manual_seed(1)
    logp = torch.randn(2, 4, generator=g, dtype=torch.float64).requires_grad_(True)
    ref = torch.randn(2, 4, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    assert torch.autograd.gradcheck(lambda x: kl_loss(x, ref, mask, kind=kind), (logp,))
    nan_ref = torch.where(mask.bool(), ref, torch.tensor(float("nan"), dtype=torch.float64))
    assert kl_loss(logp, nan_ref, mask, kind=kind).item() == pytest.approx(kl_loss(logp, ref, mask, kind=kind).item())


def test_bf16_inputs_float32_output():
    out = kl_penalty(LOGP.bfloat16(), REF.bfloat16(), "k3")
    assert out.dtype == torch.float32
    assert torch.allclose(out, kl_penalty(LOGP.bfloat16().float(), REF.bfloat16().float(), "k3"))


def test_apply_kl_penalty_fixed():
    scores = torch.tensor([[0.0, 1.0, 0.0], [0.0, 2.0, 9.0]])
    old = torch.tensor([[0.5, 0.5, 0.5], [0.0, 1.0, 99.0]])
    ref = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    ctrl = FixedKLController(0.1)
    rewards, metrics = apply_kl_penalty(scores, old, ref, mask, ctrl, "kl")
    assert rewards.flatten().tolist() == pytest.approx([-0.05, 0.95, -0.05, 0.0, 1.9, 9.0])
    assert metrics["actor/reward_kl_penalty"] == pytest.approx((0.5 + 0.5) / 2)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.1 and ctrl.value == 0.1


def test_adaptive_controller_update_rule():
    ctrl = AdaptiveKLController(init_kl_coef=0.2, target_kl=6.0, horizon=10000)
    ctrl.update(current_kl=12.0, n_steps=100)  # error clipped to +0.2
    assert ctrl.value == pytest.approx(0.2 * (1 + 0.2 * 100 / 10000))
    ctrl.update(current_kl=5.4, n_steps=100)  # error -0.1
    assert ctrl.value == pytest.approx(0.2 * 1.002 * (1 - 0.1 * 100 / 10000))
    with pytest.raises(ValueError):
        AdaptiveKLController(0.1, 1.0, 0)


def test_apply_kl_penalty_updates_adaptive_controller():
    ctrl = AdaptiveKLController(init_kl_coef=0.5, target_kl=0.1, horizon=4)
    scores = torch.zeros(2, 2)
    rewards, metrics = apply_kl_penalty(scores, torch.ones(2, 2), torch.zeros(2, 2), torch.ones(2, 2), ctrl, "k1")
    assert rewards.tolist() == [[-0.5, -0.5], [-0.5, -0.5]]  # the coefficient before the update is applied
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.5
    assert ctrl.value == pytest.approx(0.5 * (1 + 0.2 * 2 / 4))
