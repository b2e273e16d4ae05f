"""Advantage estimators: hand-computed cases, grouping, padding invariance, dtypes."""

import math
import statistics

import numpy as np
import pytest
import torch

from batchrl.training.algos import ADV_ESTIMATORS, get_adv_estimator


def outcome_rewards(scores, length=3):
    """Outcome reward on the last token of each row."""
    rewards = torch.zeros(len(scores), length)
    rewards[:, -1] = torch.tensor(scores, dtype=torch.float32)
    return rewards, torch.ones(len(scores), length)


def uniform_call(name, rewards, mask, index, **extra):
    kwargs = dict(token_level_rewards=rewards, response_mask=mask, index=index, values=None, gamma=1.0, lam=1.0,
                  reward_baselines=None, epsilon=1e-6, norm_adv_by_std=True, some_future_kwarg=1)
    kwargs.update(extra)
    return get_adv_estimator(name)(**kwargs)


def test_registry_names_and_unknown():
    assert set(ADV_ESTIMATORS) == {"gae", "grpo", "drgrpo", "rloo", "reinforce_plus_plus",
                                   "reinforce_plus_plus_baseline", "remax"}
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        get_adv_estimator("ppo")


def test_gae_hand_values():
    rewards, values = torch.tensor([[0.0, 1.0]]), torch.tensor([[0.5, 0.2]])
    mask = torch.ones(1, 2)
    adv, ret = uniform_call("gae", rewards, mask, [0], values=values, gamma=0.9, lam=0.8)
    # t=1: delta = 1 - 0.2 = 0.8 ; t=0: delta = 0.9*0.2 - 0.5 = -0.32, A0 = -0.32 + 0.72*0.8
    raw = [-0.32 + 0.72 * 0.8, 0.8]
    assert ret[0].tolist() == pytest.approx([raw[0] + 0.5, raw[1] + 0.2], rel=1e-6)
    m, s = statistics.mean(raw), statistics.stdev(raw)
    assert adv[0].tolist() == pytest.approx([(r - m) / s for r in raw], rel=1e-4)


def test_gae_carries_value_and_advantage_through_masked_tokens():
    compact = uniform_call("gae", torch.tensor([[0.0, 1.0]]), torch.ones(1, 2), [0],
                           values=torch.tensor([[0.5, 0.2]]), gamma=0.9, lam=0.8)
    # an observation token in the middle: its reward/value are skipped, the bootstrap jumps it
    rewards = torch.tensor([[0.0, 5.0, 1.0]])
    values = torch.tensor([[0.5, float("nan"), 0.2]])
    mask = torch.tensor([[1, 0, 1]])
    adv, ret = uniform_call("gae", rewards, mask, [0], values=values, gamma=0.9, lam=0.8)
    assert adv[0, [0, 2]].tolist() == pytest.approx(compact[0][0].tolist(), rel=1e-6)
    assert ret[0, [0, 2]].tolist() == pytest.approx(compact[1][0].tolist(), rel=1e-6)
    assert adv[0, 1].item() == 0.0 and ret[0, 1].item() == 0.0


def test_gae_requires_values():
    with pytest.raises(ValueError, match="values"):
        uniform_call("gae", *outcome_rewards([1.0]), [0])


def test_grpo_hand_values_group_of_two_and_one():
    rewards, mask = outcome_rewards([1.0, 0.0, 3.0])
    adv, ret = uniform_call("grpo", rewards, mask, np.array(["a", "a", "b"], dtype=object))
    std = statistics.stdev([1.0, 0.0])  # unbiased: sqrt(0.5)
    expected = [0.5 / (std + 1e-6), -0.5 / (std + 1e-6), 3.0 / (1.0 + 1e-6)]  # singleton: mean 0, std 1
    assert adv[:, 0].tolist() == pytest.approx(expected, rel=1e-6)
    assert torch.equal(adv, ret)
    assert torch.all(adv == adv[:, :1])  # broadcast over tokens


def test_grpo_group_of_n_interleaved_index_matches_contiguous():
    scores = [1.0, 2.0, 3.0, 4.0, 0.0, 1.0]
    groups = ["x", "y", "x", "y", "x", "y"]
    adv, _ = uniform_call("grpo", *outcome_rewards(scores), groups)
    for i, g in enumerate(groups):
        members = [s for s, h in zip(scores, groups) if h == g]
        expected = (scores[i] - statistics.mean(members)) / (statistics.stdev(members) + 1e-6)
        assert adv[i, 0].item() == pytest.approx(expected, rel=1e-5)


def test_grpo_identical_scores_give_zero_advantage():
    adv, _ = uniform_call("grpo", *outcome_rewards([1.0, 1.0, 1.0, 1.0]), [0, 0, 0, 0])
    assert torch.count_nonzero(adv) == 0


def test_drgrpo_skips_std_even_if_asked():
    adv, _ = uniform_call("drgrpo", *outcome_rewards([1.0, 0.0, 0.0, 0.0, 7.0]), [0, 0, 0, 0, 1], norm_adv_by_std=True)
    assert adv[:, 0].tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25, 7.0])


def test_grpo_norm_off_equals_drgrpo():
    rewards, mask = outcome_rewards([2.0, 5.0, 1.0])
    a, _ = uniform_call("grpo", rewards, mask, [1, 1, 1], norm_adv_by_std=False)
    b, _ = uniform_call("drgrpo", rewards, mask, [1, 1, 1])
    assert torch.equal(a, b)


def test_rloo_leave_one_out_and_singleton():
    adv, ret = uniform_call("rloo", *outcome_rewards([1.0, 2.0, 3.0, 4.0]), ["g", "g", "g", "solo"])
    # 1 - (2+3)/2, 2 - (1+3)/2, 3 - (1+2)/2 ; a group of one keeps its score (verl)
    assert adv[:, 0].tolist() == pytest.approx([-1.5, 0.0, 1.5, 4.0])
    assert torch.equal(adv, ret)


def test_reinforce_plus_plus_discounted_whitened():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    adv, ret = uniform_call("reinforce_plus_plus", rewards, torch.ones(1, 3), [0], gamma=0.5)
    assert ret[0].tolist() == pytest.approx([0.25, 0.5, 1.0])
    g = [0.25, 0.5, 1.0]
    expected = [(x - statistics.mean(g)) / statistics.stdev(g) for x in g]
    assert adv[0].tolist() == pytest.approx(expected, rel=1e-5)


def test_reinforce_plus_plus_baseline_group_mean_then_batch_whitening():
    rewards, mask = outcome_rewards([1.0, 3.0, 5.0], length=2)
    adv, ret = uniform_call("reinforce_plus_plus_baseline", rewards, mask, ["a", "a", "b"])
    centred = [1.0 - 2.0, 3.0 - 2.0, 5.0]  # singleton: mean 0
    tokens = [c for c in centred for _ in range(2)]
    m, s = statistics.mean(tokens), statistics.stdev(tokens)
    assert adv[:, 0].tolist() == pytest.approx([(c - m) / s for c in centred], rel=1e-5)
    assert torch.equal(adv, ret)


def test_remax_greedy_baseline():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = uniform_call("remax", rewards, mask, [0, 1], reward_baselines=torch.tensor([0.5, 1.0]))
    assert ret.tolist() == [[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]]
    assert adv.tolist() == [[0.5, 0.5, 0.5], [1.0, 1.0, 0.0]]
    with pytest.raises(ValueError, match="reward_baselines"):
        uniform_call("remax", rewards, mask, [0, 1])


def _random_batch(seed=0, batch=6, length=5):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(batch, length, generator=g)
    lengths = torch.tensor([5, 3, 4, 1, 5, 2])[:batch]
    mask = (torch.arange(length)[None, :] < lengths[:, None]).float()
    values = torch.randn(batch, length, generator=g)
    return rewards, mask, values


@pytest.mark.parametrize("name", sorted(ADV_ESTIMATORS))
def test_padding_never_changes_result(name):
    rewards, mask, values = _random_batch()
    index = ["a", "a", "b", "b", "b", "c"]
    baselines = torch.randn(6)
    adv, ret = uniform_call(name, rewards, mask, index, values=values, reward_baselines=baselines, gamma=0.9, lam=0.95)
    pad = 3
    garbage = torch.full((6, pad), float("nan"))
    padded_rewards = torch.cat([torch.where(mask.bool(), rewards, torch.tensor(7.0)), garbage], dim=1)
    padded_values = torch.cat([torch.where(mask.bool(), values, torch.tensor(float("nan"))), garbage], dim=1)
    padded_mask = torch.cat([mask, torch.zeros(6, pad)], dim=1)
    adv_p, ret_p = uniform_call(name, padded_rewards, padded_mask, index, values=padded_values,
                                reward_baselines=baselines, gamma=0.9, lam=0.95)
    assert torch.allclose(adv_p[:, :5], adv, atol=1e-6)
    assert torch.allclose(ret_p[:, :5], ret, atol=1e-6)
    assert torch.count_nonzero(adv_p * (1 - padded_mask)) == 0
    assert torch.isfinite(adv_p).all() and torch.isfinite(ret_p).all()


@pytest.mark.parametrize("name", sorted(ADV_ESTIMATORS))
def test_bf16_inputs_give_float32_results(name):
    rewards, mask, values = _random_batch(seed=1)
    rewards16, values16 = rewards.bfloat16(), values.bfloat16()
    kwargs = dict(values=values16, reward_baselines=torch.randn(6).bfloat16(), gamma=0.9, lam=0.95)
    adv16, ret16 = uniform_call(name, rewards16, mask.bfloat16(), [0, 0, 1, 1, 1, 2], **kwargs)
    kwargs32 = {k: (v.float() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    adv32, ret32 = uniform_call(name, rewards16.float(), mask, [0, 0, 1, 1, 1, 2], **kwargs32)
    assert adv16.dtype == torch.float32 and ret16.dtype == torch.float32
    assert torch.allclose(adv16, adv32, atol=1e-6) and torch.allclose(ret16, ret32, atol=1e-6)


@pytest.mark.parametrize("name", ["grpo", "drgrpo", "rloo", "reinforce_plus_plus_baseline"])
def test_group_estimators_invariant_to_row_permutation(name):
    rewards, mask, _ = _random_batch(seed=2)
    index = np.array([10, 11, 10, 12, 11, 10])
    adv, _ = uniform_call(name, rewards, mask, index)
    perm = torch.tensor([5, 2, 0, 4, 1, 3])
    adv_perm, _ = uniform_call(name, rewards[perm], mask[perm], index[perm.numpy()])
    assert torch.allclose(adv_perm, adv[perm], atol=1e-6)


def test_grpo_no_grad_and_finite_for_all_singletons():
    rewards, mask = outcome_rewards([1.0, -2.0])
    rewards.requires_grad_(True)
    adv, _ = uniform_call("grpo", rewards, mask, ["p", "q"])
    assert not adv.requires_grad
    assert adv[:, 0].tolist() == pytest.approx([1.0 / (1 + 1e-6), -2.0 / (1 + 1e-6)])
    assert all(math.isfinite(x) for x in adv.flatten().tolist())
