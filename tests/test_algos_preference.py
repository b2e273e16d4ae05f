"""DPO-family losses (TRL 1.x conventions), metrics, Bradley-Terry."""

import math

import pytest
import torch

from batchrl.training.algos import (
    PREFERENCE_LOSSES,
    bradley_terry_loss,
    dpo_loss,
    get_preference_loss,
    preference_metrics,
)

# policy chosen/rejected, ref chosen/rejected: h = (-1 + 2) - (-1.5 + 1.5) = 1
LOGPS = [torch.tensor([v]) for v in (-1.0, -2.0, -1.5, -1.5)]
BETA = 0.1


def softplus(x):
    return math.log1p(math.exp(x))


@pytest.mark.parametrize(
    "loss_type,smoothing,expected",
    [
        ("sigmoid", 0.0, softplus(-0.1)),
        ("sigmoid", 0.1, 0.9 * softplus(-0.1) + 0.1 * softplus(0.1)),
        ("robust", 0.1, (0.9 * softplus(-0.1) - 0.1 * softplus(0.1)) / 0.8),
        ("hinge", 0.0, 0.9),
    ],
)
def test_dpo_hand_values(loss_type, smoothing, expected):
    losses, chosen, rejected = dpo_loss(*LOGPS, beta=BETA, loss_type=loss_type, label_smoothing=smoothing)
    assert losses.item() == pytest.approx(expected, rel=1e-6)
    assert chosen.item() == pytest.approx(0.05) and rejected.item() == pytest.approx(-0.05)


def test_ipo_is_length_normalised():
    losses, chosen, rejected = dpo_loss(*LOGPS, beta=BETA, loss_type="ipo", chosen_lengths=torch.tensor([2]),
                                        rejected_lengths=torch.tensor([4]))
    h = (-1 / 2 - (-2) / 4) - (-1.5 / 2 - (-1.5) / 4)  # = 0.375
    assert losses.item() == pytest.approx((h - 1 / (2 * BETA)) ** 2, rel=1e-6)
    assert chosen.item() == pytest.approx(BETA * (-1 / 2 + 1.5 / 2))
    assert rejected.item() == pytest.approx(BETA * (-2 / 4 + 1.5 / 4))  # per token of the rejected completion too
    with pytest.raises(ValueError, match="lengths"):
        dpo_loss(*LOGPS, loss_type="ipo")


def test_registry_matches_dpo_loss():
    assert set(PREFERENCE_LOSSES) == {"sigmoid", "ipo", "robust", "hinge"}
    lengths = dict(chosen_lengths=[3], rejected_lengths=[5])
    for name in PREFERENCE_LOSSES:
        a = get_preference_loss(name)(*LOGPS, beta=0.3, **lengths)[0]
        b = dpo_loss(*LOGPS, beta=0.3, loss_type=name, **lengths)[0]
        assert torch.equal(a, b)
    with pytest.raises(ValueError):
        get_preference_loss("kto")
    with pytest.raises(ValueError):
        dpo_loss(*LOGPS, loss_type="kto")


def test_robust_smoothing_bound():
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(*LOGPS, loss_type="robust", label_smoothing=0.5)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "robust", "hinge"])
def test_dpo_gradcheck_float64(loss_type):
    g = torch.Generator().manual_seed(0)
    pc, pr = (torch.randn(4, generator=g, dtype=torch.float64).requires_grad_(True) for _ in range(2))
    rc, rr = (torch.randn(4, generator=g, dtype=torch.float64) for _ in range(2))
    lengths = dict(chosen_lengths=torch.tensor([1, 2, 3, 4]), rejected_lengths=torch.tensor([4, 3, 2, 1]))

    def total(pc, pr):
        return dpo_loss(pc, pr, rc, rr, beta=0.5, loss_type=loss_type, label_smoothing=0.2, **lengths)[0].sum()

    assert torch.autograd.gradcheck(total, (pc, pr))


def test_rewards_are_detached_and_bf16_upcast():
    pc = torch.tensor([-1.0, -3.0], dtype=torch.bfloat16, requires_grad=True)
    pr = torch.tensor([-2.0, -1.0], dtype=torch.bfloat16, requires_grad=True)
    losses, chosen, rejected = dpo_loss(pc, pr, torch.tensor([-1.5, -2.0], dtype=torch.bfloat16),
                                        torch.tensor([-1.5, -1.0], dtype=torch.bfloat16))
    assert losses.dtype == torch.float32 and losses.requires_grad
    assert not chosen.requires_grad and not rejected.requires_grad


def test_preference_metrics():
    metrics = preference_metrics(torch.tensor([0.3, -0.1]), torch.tensor([0.1, 0.2]))
    assert metrics == pytest.approx({"rewards/chosen": 0.1, "rewards/rejected": 0.15, "rewards/margins": -0.05,
                                     "rewards/accuracies": 0.5})
    assert all(isinstance(v, float) for v in metrics.values())


def test_bradley_terry_hand_values():
    loss, metrics = bradley_terry_loss(torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0]))
    assert loss.item() == pytest.approx((softplus(-1) + softplus(1)) / 2, rel=1e-6)
    assert metrics["accuracy"].item() == 0.5 and metrics["margin"].item() == 0.0
    loss_m, _ = bradley_terry_loss(torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0]), margin=torch.tensor([0.5, 0.0]))
    assert loss_m.item() == pytest.approx((softplus(-0.5) + softplus(1)) / 2, rel=1e-6)


def test_bradley_terry_gradcheck():
    g = torch.Generator().manual_seed(2)
    c, r = (torch.randn(5, 1, generator=g, dtype=torch.float64).requires_grad_(True) for _ in range(2))
    margin = torch.rand(5, generator=g, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda c, r: bradley_terry_loss(c, r, margin=margin)[0], (c, r))
