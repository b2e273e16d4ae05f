"""One-step off-policy RL iterations (the RL recipe's ``off_policy_steps: 1``, issue 32; assets/rollout_prefetch.py).

An iteration's rollouts come from the promoted policy's parent, one update behind; the job worker's rollouts worker
samples the next iteration's while this one's update trains. Prefetched or sampled then and there, they are the
same samples: three iterations with the rollouts sampled by the job worker (prefetching) and in the Dagster process
(nothing samples ahead) give the same data versions at every stage.
"""
from __future__ import annotations

import pytest
from pipeline_helpers import RL_LOOP, recipe, seeded_rl_iterations, stop_workers

from batchrl.assets.rollout_prefetch import NO_NEXT_ITERATION, NO_PREFETCH_WORKER
from batchrl.assets.run_rules import check_run_config
from batchrl.resources.rl_recipe import RLRecipe
from batchrl.runs.run_config import RunConfigError

OFF_POLICY = {"ops": {  # on the upstream assets of the `upstream_copy` fixture (pipeline_helpers.TINY_BASE)
    "rollouts": {"config": {"max_prompts": 8}},
    "rewards": {"config": {"weights": {"rule": 1.0, "reward_model": 0.0}}},
    "policy_checkpoint": {"config": {"micro_batch_size": 4, "lr": 1.0e-3}},
}, "resources": recipe(samples_per_prompt=2, off_policy_steps=1)}
ITERATIONS = 3


def test_off_policy_iterations_sample_one_update_behind_and_the_prefetch_changes_no_result(tmp_path, upstream_copy):
    runs = {name: seeded_rl_iterations(*upstream_copy(tmp_path / name), OFF_POLICY, ITERATIONS, name == "ahead")
            for name in ("ahead", "in_process")}
    ahead, fresh = runs["ahead"], runs["in_process"]
    try:
        for stage in RL_LOOP:
            assert [m["data_version"] for m in ahead[stage]] == [m["data_version"] for m in fresh[stage]], stage
            assert len(ahead[stage]) == ITERATIONS
        # iteration 1 samples the base model; each later one the policy before the promoted one
        policies = [m["data_version"] for m in ahead["policy_checkpoint"]]
        base = ahead["base_model"][0]["data_version"]
        assert [m["staleness"] for m in ahead["rollouts"]] == [0, 1, 1]
        assert [m["policy"].rstrip("/").rsplit("/", 1)[-1] for m in ahead["rollouts"]] == [base, base, policies[0]]
        # the samples of iterations 2 and 3 were taken from the prefetch, sampled while the update before trained
        assert [m["prefetched"] for m in ahead["rollouts"]] == [False, True, True]
        # with the seeds the runs announced; the last run announced no next iteration: nothing sampled for nobody
        assert [m.get("prefetch_seed") for m in ahead["rollouts"]] == ["1", "2", None]  # a seed: text, not a series
        assert [m["prefetch"] for m in ahead["rollouts"]] == ["started", "started", NO_NEXT_ITERATION]
        assert not any(m["prefetched"] for m in fresh["rollouts"])
        assert not any("prefetch_seed" in m for m in fresh["rollouts"])
        assert [m["prefetch"] for m in fresh["rollouts"]] == [NO_PREFETCH_WORKER] * 2 + [NO_NEXT_ITERATION]
        # each update trains the promoted policy (not the samples' own) and corrects the staleness by importance
        # weights against the engine's log-probs, which differ from 1 once the samples are one update behind
        weights = [m["final/rollout_is_weight_mean"] for m in ahead["policy_checkpoint"]]
        assert all(0 < w <= 2.0 for w in weights) and abs(weights[2] - 1.0) > 1e-4
    finally:
        stop_workers(runs)
    # reproduce pins each off-policy rollouts step's promoted policy apart from the one it sampled: the third
    # iteration's rollouts (policy 1's samples while policy 2 was promoted) come out equal from their lineage alone
    from batchrl.runs.reproduce import reproduce

    last = fresh["rollouts"][-1]["data_version"]
    report = reproduce(str(tmp_path / "in_process" / "storage" / "rollouts" / last), str(tmp_path / "again"),
                       log=lambda line: None)
    assert report["equal"], report["first_difference"]
    assert [row["asset"] for row in report["assets"]].count("policy_checkpoint") == 2


def test_off_policy_needs_the_recomputed_ratio_the_importance_correction_and_no_critic():
    """Rules within the recipe: refused when it is written (a profile's, a -c file's), and by the up-front check
    of a run config's ``resources.rl_recipe``."""
    for fields in ({"old_logprobs": "rollout"}, {"rollout_is_threshold": None}, {"estimator": "gae"}):
        with pytest.raises(ValueError, match="off_policy_steps 1"):
            RLRecipe(off_policy_steps=1, **fields)
        with pytest.raises(RunConfigError, match="resources.rl_recipe: off_policy_steps 1"):
            check_run_config({"resources": recipe(off_policy_steps=1, **fields)})
    check_run_config({"resources": recipe(off_policy_steps=1)})  # the defaults: recompute, threshold 2
    with pytest.raises(RunConfigError, match="resources.rl_recipe.off_policy_steps=2: Input should be less than or "
                                             "equal to 1"):
        check_run_config({"resources": recipe(off_policy_steps=2)})


def test_an_off_policy_run_starts_the_rollouts_worker_with_the_others():
    from batchrl.cli.run_command import _named_workers

    assert _named_workers(RLRecipe(off_policy_steps=1)) == ("rollouts",)
    assert _named_workers(RLRecipe()) == ()
