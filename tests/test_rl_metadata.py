"""An RL iteration's headline numbers in the UI (issue 34): each RL stage carries the chain's iteration as a
number, the rewards their spread, components and per-category means as numbers (each a series in the Plots tab),
the advantages and the update their KL coefficients; run details that are numbers but measure nothing (seed,
world size, hashing time, weight-cache counts) are text, not plots. Two iterations on the tiny model (~2 min)."""
from __future__ import annotations

import base64

import dagster as dg
import pytest
from pipeline_helpers import RL_LOOP, TINY_BASE, UPSTREAM, latest_metadata, local_resources, run_assets

from batchrl.resources.rl_recipe import RLRecipe

TINY = {"base_model": {"config": {"hidden_size": 64, "intermediate_size": 128, "num_layers": 1}},
        "rollouts": {"config": {"max_prompts": 4}}}
NUMBER = (int, float)


@pytest.fixture(scope="module")
def two_iterations(module_upstream):
    """Two RL iterations on the session's UPSTREAM (``TINY``'s base model), copied."""
    assert TINY["base_model"] == TINY_BASE["ops"]["base_model"]
    root, home = module_upstream
    with dg.DagsterInstance.local_temp(home) as instance:
        resources = local_resources(root, rl_recipe=RLRecipe(samples_per_prompt=2))
        assert all(instance.get_latest_materialization_event(dg.AssetKey(a)) for a in UPSTREAM)
        assert run_assets(resources, instance, RL_LOOP, {"ops": TINY}).success
        first = {asset: latest_metadata(instance, asset) for asset in [*RL_LOOP, "promoted_policy"]}
        second_config = {"rollouts": {"config": {**TINY["rollouts"]["config"], "seed": 1}}}
        assert run_assets(resources, instance, RL_LOOP, {"ops": second_config}).success
        second = {asset: latest_metadata(instance, asset) for asset in [*RL_LOOP, "promoted_policy"]}
        yield first, second, instance


def test_every_rl_stage_carries_its_iteration_as_a_number(two_iterations):
    first, second, _ = two_iterations
    for asset in [*RL_LOOP, "promoted_policy"]:
        assert first[asset]["iteration"] == 1 and second[asset]["iteration"] == 2, asset
    assert second["policy_checkpoint"]["data_version"] != first["policy_checkpoint"]["data_version"]


def test_rewards_show_spread_components_and_categories_as_numbers(two_iterations):
    rewards = two_iterations[0]["rewards"]
    for key in ("mean_reward", "reward_std", "reward_min", "reward_max", "mean_reward/rule",
                "mean_reward_by_category/arith"):
        assert isinstance(rewards[key], NUMBER) and not isinstance(rewards[key], bool), key
    assert rewards["reward_min"] <= rewards["mean_reward"] <= rewards["reward_max"]
    assert "mean_reward/reward_model" not in rewards  # weight 0: the reward model was not run
    assert rewards["mean_reward"] == pytest.approx(rewards["mean_reward/rule"])  # the mix is the rule alone


def test_kl_coefficients_and_rollout_numbers_are_plottable(two_iterations):
    first = two_iterations[0]
    assert first["advantages"]["kl_in_reward_coef"] == 0.0  # by default the KL is a loss term of the update
    assert first["policy_checkpoint"]["kl_loss_coef"] == pytest.approx(0.01)
    assert isinstance(first["rollouts"]["mean_response_tokens"], NUMBER)
    assert 0.0 <= first["rollouts"]["stop_rate"] <= 1.0


def test_run_details_are_text_not_plots(two_iterations):
    checkpoint = two_iterations[0]["policy_checkpoint"]
    for key in ("seed", "world_size", "hash_s", "weight_cache_hits", "weight_cache_misses"):
        assert isinstance(checkpoint[key], str), key
    assert checkpoint["world_size"] == "1" and checkpoint["seed"] == "0"
    assert isinstance(checkpoint["global_step"], int) and isinstance(checkpoint["job_wall_s"], float)


def test_each_promotion_draws_the_chain_against_its_iteration(two_iterations):
    """Dagster plots numbers against time: each promotion carries a chart of the chain so far whose x-axis is the
    iteration, from the stages' numbers that name their chain (another base model's chain is not mixed in)."""
    from batchrl.assets.charts import png_size
    from batchrl.assets.iteration_chart import STAGES, chain_history, iteration_panels

    first, second, instance = two_iterations
    chain = second["promoted_policy"]["chain_base"]
    assert chain == f"base_model@{latest_metadata(instance, 'base_model')['data_version']}"
    assert all(meta[asset]["chain_base"] == chain for meta in (first, second) for asset in RL_LOOP)
    history = chain_history(instance, chain)
    assert {asset: sorted(history[asset]) for asset in STAGES} == {asset: [1, 2] for asset in STAGES}
    assert [history["rewards"][i]["mean_reward"] for i in (1, 2)] == \
        [first["rewards"]["mean_reward"], second["rewards"]["mean_reward"]]
    panels = iteration_panels(history)
    assert panels["reward"]["mean_reward"] == ([1, 2], [history["rewards"][i]["mean_reward"] for i in (1, 2)])
    assert set(panels["KL coefficient"]) == {"kl_in_reward_coef", "kl_loss_coef"}
    assert "mean_reward_by_category/arith" in panels["reward by category"]
    assert iteration_panels(history, upto=1)["reward"]["mean_reward"][0] == [1]
    assert chain_history(instance, "base_model@another") == {asset: {} for asset in STAGES}
    for meta in (first, second):  # a PNG in Markdown, at the charts' width (3 panels of 3 inches at 72 dpi)
        markdown = meta["promoted_policy"]["iterations_chart"]
        assert markdown.startswith("![the RL chain per iteration](data:image/png;base64,")
        assert png_size(base64.b64decode(markdown.split("base64,", 1)[1].rstrip(")")))[0] == 648
