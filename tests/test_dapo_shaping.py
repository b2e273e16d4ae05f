"""DAPO's batch shaping (issue 48): the soft overlong punishment in the reward, overlong filtering (truncated
samples out of the policy loss) and dynamic sampling (groups of identical rewards out of the batch) — the
formulas on hand-computed values, the configs' refusals, then the three on together through the RL stages on
the tiny default (~1 min)."""
from __future__ import annotations

import dagster as dg
import numpy as np
import pandas as pd
import pytest
import torch
from pipeline_helpers import RL_LOOP, TINY_BASE, UPSTREAM, latest_metadata, local_resources, recipe, run_assets
from pydantic import ValidationError

from batchrl.resources import StorageResource
from batchrl.training.rl.advantages import AdvantageSettings, compute_advantages
from batchrl.training.algos import compute_overlong_penalty, dynamic_sampling_keep, overlong_filter_mask
from batchrl.training.rewards.registry import OverlongBuffer, RewardConfig, compute_rewards


def test_overlong_penalty_is_zero_then_linear_through_the_buffer_then_minus_one():
    # L_max 10, L_cache 4: free up to 6 tokens, (6 - |y|) / 4 from 7 to 10, -1 past 10
    lengths = torch.tensor([0, 6, 7, 8, 9, 10, 12])
    got = compute_overlong_penalty(lengths, max_response_length=10, buffer_length=4)
    assert got.tolist() == [0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0]
    scaled = compute_overlong_penalty(lengths, max_response_length=10, buffer_length=4, penalty_factor=0.5)
    assert scaled.tolist() == [0.0, 0.0, -0.125, -0.25, -0.375, -0.5, -0.5]


@pytest.mark.parametrize("buffer_length", [0, 10, 11])
def test_overlong_buffer_must_lie_inside_the_limit(buffer_length):
    with pytest.raises(ValueError, match="overlong buffer length"):
        compute_overlong_penalty(torch.tensor([5]), max_response_length=10, buffer_length=buffer_length)


def test_overlong_filter_zeroes_the_truncated_rows_only():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 1.0]])
    got = overlong_filter_mask(mask, torch.tensor([False, True, False]))
    assert got.tolist() == [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 1.0]]


def test_dynamic_sampling_keeps_groups_with_a_spread_and_groups_of_one():
    scores = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.5, 2.0, 2.0])
    index = ["a", "a", "a", "b", "b", "b", "c", "d", "d"]
    assert dynamic_sampling_keep(scores, index).tolist() == [False] * 3 + [True] * 4 + [False] * 2
    assert dynamic_sampling_keep(torch.zeros(0), []).tolist() == []


@pytest.mark.parametrize("buffer", [{"length": 0}, {"length": -3}, {"length": 4, "penalty_factor": 0},
                                    {"length": 4, "penalty_factor": float("inf")}, {"length": 4, "factor": 1.0}])
def test_overlong_buffer_config_refuses_bad_values(buffer):
    with pytest.raises(ValidationError):
        RewardConfig(overlong_buffer=buffer)


def _rollout_rows(lengths: list[int]) -> pd.DataFrame:
    n = len(lengths)
    return pd.DataFrame({"prompt": ["1+1="] * n, "response": ["2"] * n, "answer": ["2"] * n, "category": ["arith"] * n,
                         "response_ids": [[7] * k for k in lengths]})


def test_rewards_add_the_overlong_penalty_to_the_mix():
    cfg = RewardConfig(rule="arith_exact", overlong_buffer=OverlongBuffer(length=4, penalty_factor=2.0))
    scored = compute_rewards(_rollout_rows([3, 6, 8, 10]), cfg, max_response_length=10)
    assert scored["overlong_penalty"].tolist() == [0.0, 0.0, -1.0, -2.0]
    assert scored["reward"].tolist() == [1.0, 1.0, 0.0, -1.0]
    assert "overlong_penalty" not in compute_rewards(_rollout_rows([10]), RewardConfig(rule="arith_exact"))


def test_rewards_refuse_an_overlong_buffer_without_a_fitting_limit():
    cfg = RewardConfig(rule="arith_exact", overlong_buffer={"length": 4})
    with pytest.raises(ValueError, match="token limit"):
        compute_rewards(_rollout_rows([3]), cfg)
    with pytest.raises(ValueError, match="must be smaller"):
        compute_rewards(_rollout_rows([3]), cfg, max_response_length=4)


@pytest.mark.parametrize("settings, message", [
    ({"estimator": "reinforce_plus_plus", "dynamic_sampling": True}, "group estimator"),
    ({"estimator": "gae", "dynamic_sampling": True}, "group estimator"),
    ({"when_all_groups_dropped": "fail"}, "dynamic_sampling is off"),
    ({"dynamic_sampling": True, "when_all_groups_dropped": "skip"}, "keep_batch"),
])
def test_advantage_settings_refuse_shaping_that_cannot_work(settings, message):
    with pytest.raises(ValidationError, match=message):
        AdvantageSettings(**settings)


def _scored(rewards: list[float], groups: list[int], finish: list[str] | None = None) -> pd.DataFrame:
    return pd.DataFrame({"prompt_index": groups, "reward": rewards, "response_ids": [[5, 6, 7]] * len(rewards),
                         "finish_reason": finish or ["stop"] * len(rewards)})


def test_dynamic_sampling_drops_identical_groups_before_the_estimator():
    table = _scored([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5], [0, 0, 1, 1, 2, 2, 3])
    out = compute_advantages(table, "grpo", dynamic_sampling=True)
    assert out["prompt_index"].tolist() == [1, 1, 3]
    assert out.attrs["metrics"] == {"dynamic_sampling/groups_identical": 2, "dynamic_sampling/groups_kept": 2,
                                    "dynamic_sampling/groups_dropped": 2, "dynamic_sampling/samples_dropped": 4,
                                    "dynamic_sampling/all_groups_identical": 0}
    # group 1 (0, 1): (r - 0.5) / (std 0.7071 + 1e-6) = -/+0.7071 on every token; the group of one passes 0.5
    assert np.allclose(out["advantages"].tolist(), [[-0.7071] * 3, [0.7071] * 3, [0.5] * 3], atol=1e-4)


def test_dynamic_sampling_with_every_group_identical_keeps_the_batch_or_fails():
    table = _scored([1.0, 1.0, 0.0, 0.0], [0, 0, 1, 1])
    out = compute_advantages(table, "grpo", dynamic_sampling=True)
    assert len(out) == 4 and not np.any(out["advantages"].tolist())
    assert out.attrs["metrics"]["dynamic_sampling/all_groups_identical"] == 1
    assert out.attrs["metrics"]["dynamic_sampling/groups_dropped"] == 0
    with pytest.raises(ValueError, match="all 2 groups have identical rewards"):
        compute_advantages(table, "grpo", dynamic_sampling=True, when_all_groups_dropped="fail")


def test_overlong_filter_masks_truncated_samples_but_keeps_them_in_the_group():
    table = _scored([1.0, 0.0, 0.0, 1.0], [0, 0, 0, 0], ["stop", "length", "stop", "length"])
    plain = compute_advantages(table, "grpo")
    out = compute_advantages(table, "grpo", overlong_filter=True)
    assert out["advantages"].tolist() == plain["advantages"].tolist()  # the group's mean/std still count them
    assert out["loss_mask"].tolist() == [[1.0] * 3, [0.0] * 3, [1.0] * 3, [0.0] * 3]
    assert out.attrs["metrics"] == {"overlong_filtered": 2, "overlong_filtered_rate": 0.5}


TINY = {"base_model": {"config": {"hidden_size": 64, "intermediate_size": 128, "num_layers": 1}}}
SMALL_ROLLOUTS = {"max_prompts": 6}
RECIPE = recipe(samples_per_prompt=3)


@pytest.fixture(scope="module")
def upstream(module_upstream):
    """UPSTREAM with ``TINY``'s base model: the session's, copied."""
    assert TINY["base_model"] == TINY_BASE["ops"]["base_model"]
    root, home = module_upstream
    with dg.DagsterInstance.local_temp(home) as instance:
        assert all(instance.get_latest_materialization_event(dg.AssetKey(a)) for a in UPSTREAM)
        yield instance, root


def _table(instance, root: str, asset: str) -> pd.DataFrame:
    meta = latest_metadata(instance, asset)
    ref = {"asset": asset, "uri": meta["uri"], "data_version": meta["data_version"]}
    return pd.read_parquet(f"{StorageResource(root=root).localize(ref)}/{asset}.parquet")


def test_dapo_shaping_through_the_rl_stages(upstream):
    """Rollouts of at most 12 tokens (the tiny default's max_new_tokens) with a 4-token buffer: longer than 8
    tokens pays; the truncated leave the loss; groups of identical rewards leave the batch; the update trains."""
    instance, root = upstream
    ops = {"rollouts": {"config": SMALL_ROLLOUTS},
           "rewards": {"config": {"overlong_buffer": {"length": 4, "penalty_factor": 0.5}}},
           "advantages": {"config": {"dynamic_sampling": True, "overlong_filter": True}}}
    result = run_assets(local_resources(root), instance, RL_LOOP, {"ops": ops, "resources": RECIPE})
    assert result.success
    rollouts, rewards = _table(instance, root, "rollouts"), _table(instance, root, "rewards")
    lengths = np.array([len(ids) for ids in rewards["response_ids"]])
    assert np.allclose(rewards["overlong_penalty"], -0.5 * np.clip((lengths - 8) / 4, 0, 1))
    assert np.allclose(rewards["reward"], rewards["rule"] + rewards["overlong_penalty"])
    reward_meta = latest_metadata(instance, "rewards")
    assert reward_meta["overlong/penalised"] == int((lengths > 8).sum()) > 0 and len(rollouts) == 18

    advantages, meta = _table(instance, root, "advantages"), latest_metadata(instance, "advantages")
    spread = rewards.groupby("prompt_index")["reward"].nunique() > 1
    if spread.any():  # the groups with a reward spread are the batch
        assert sorted(advantages["prompt_index"].unique()) == sorted(spread[spread].index)
        assert meta["dynamic_sampling/groups_kept"] == spread.sum()
        assert meta["dynamic_sampling/groups_dropped"] == (~spread).sum()
    else:  # nothing to learn from: the whole batch, said so
        assert len(advantages) == 18 and "every group's rewards were identical" in meta["dynamic_sampling"]
    truncated = advantages["finish_reason"] == "length"
    assert meta["overlong_filtered"] == truncated.sum() > 0
    assert all(not any(m) for m in advantages["loss_mask"][truncated])
    assert all(all(m) for m in advantages["loss_mask"][~truncated])
    assert latest_metadata(instance, "policy_checkpoint")["num_samples"] == len(advantages)


def test_every_group_identical_fails_the_advantages_step_when_asked(upstream):
    instance, root = upstream
    ops = {"rollouts": {"config": SMALL_ROLLOUTS}, "rewards": {"config": {"weights": {"rule": 0.0}}},
           "advantages": {"config": {"dynamic_sampling": True, "when_all_groups_dropped": "fail"}}}
    result = run_assets(local_resources(root), instance, RL_LOOP, {"ops": ops, "resources": RECIPE})
    failures = [str(e.event_specific_data.error) for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    assert not result.success and len(failures) == 1 and "all 6 groups have identical rewards" in failures[0]
