"""Offline objectives (SimPO, ORPO, KTO, AWR/RWR): hand values from the papers' formulas, TRL's conventions."""
import math

import pytest
import torch

from batchrl.training.algos import (awr_weights, kto_kl_reference_point, kto_loss, orpo_loss, rwr_weights,
                                    simpo_loss, weighted_regression_loss)


def _logsig(x):
    return -math.log1p(math.exp(-x))


def test_simpo_hand_value_and_margin():
    losses, rc, rr = simpo_loss(torch.tensor([-0.5]), torch.tensor([-1.5]), beta=2.0, gamma=0.5)
    h = (-0.5 + 1.5) - 0.5 / 2.0
    assert losses.item() == pytest.approx(-_logsig(2.0 * h))
    assert (rc.item(), rr.item()) == pytest.approx((-1.0, -3.0))
    # the margin gamma makes equal likelihoods a loss above log 2
    tie, _, _ = simpo_loss(torch.tensor([-1.0]), torch.tensor([-1.0]), beta=2.0, gamma=0.5)
    assert tie.item() > math.log(2)


def test_orpo_hand_value():
    pc, pr, nll = -0.2, -1.0, 0.2
    losses, _, _ = orpo_loss(torch.tensor([pc]), torch.tensor([pr]), torch.tensor([nll]), beta=0.1)
    log_odds = (pc - pr) - (math.log(1 - math.exp(pc)) - math.log(1 - math.exp(pr)))
    assert losses.item() == pytest.approx(nll - 0.1 * _logsig(log_odds), rel=1e-6)


def test_orpo_is_finite_for_a_certain_completion():
    losses, _, _ = orpo_loss(torch.tensor([0.0]), torch.tensor([-1.0]), torch.tensor([0.0]))
    assert torch.isfinite(losses).all()


def test_kto_hand_values_and_reference_point():
    z0 = kto_kl_reference_point(torch.tensor([-3.0, -2.0]), torch.tensor([-3.5, -2.5]))
    assert z0.item() == pytest.approx(0.5) and not z0.requires_grad
    assert kto_kl_reference_point(torch.tensor([-3.0]), torch.tensor([-2.0])).item() == 0.0  # clamped at 0
    logp = torch.tensor([-1.0, -1.0], requires_grad=True)
    losses, rewards = kto_loss(logp, torch.tensor([-2.0, -2.0]), torch.tensor([True, False]), z0, beta=0.1,
                               desirable_weight=1.0, undesirable_weight=1.5)
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    assert losses.tolist() == pytest.approx([1 - sig(0.1 * (1.0 - 0.5)), 1.5 * (1 - sig(0.1 * (0.5 - 1.0)))])
    assert rewards.tolist() == pytest.approx([0.1, 0.1])
    losses.sum().backward()  # up pushes logp up, down pushes it down
    assert logp.grad[0] < 0 < logp.grad[1]


def test_awr_weights_clip_and_rwr_weights_normalise_per_group():
    assert awr_weights(torch.tensor([0.0, 1.0, 10.0]), beta=1.0, max_weight=5.0).tolist() == pytest.approx(
        [1.0, math.e, 5.0])
    w = rwr_weights(torch.tensor([1.0, 0.0, 5.0, 5.0, 2.0]), [0, 0, 1, 1, 2], beta=1.0)
    assert w[:2].sum().item() == pytest.approx(2.0) and w[0] > w[1]
    assert w[2:4].tolist() == pytest.approx([1.0, 1.0]) and w[4].item() == pytest.approx(1.0)


def test_weighted_regression_raises_likelihood_of_heavier_completions():
    logps = torch.zeros(2, 3, requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    loss, metrics = weighted_regression_loss(logps, mask, torch.tensor([2.0, 0.5]))
    assert loss.item() == pytest.approx(0.0) and metrics["weight_max"].item() == 2.0
    loss.backward()
    assert logps.grad[0, 0] == pytest.approx(-2.0 / 5) and logps.grad[1, 0] == pytest.approx(-0.5 / 5)
    assert logps.grad[0, 2] == 0
