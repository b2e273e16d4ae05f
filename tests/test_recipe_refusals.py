"""Impossible RL recipes and stage configs refused before anything runs, in one line naming their fields; old
field names refused with their new place; the config schema's registered names (``resources.rl_recipe``)."""
from __future__ import annotations

import dagster as dg
import pytest
from pipeline_helpers import local_resources, recipe, run_assets

from batchrl.assets.run_rules import check_run_config
from batchrl.common.run_config_error import RunConfigError


def test_the_materialised_advantages_rule_compares_lineage_with_the_recipe():
    from batchrl.assets.run_rules import materialised_advantages_problem
    from batchrl.resources.rl_recipe import RLRecipe

    agree = [({"estimator": "grpo", "use_kl_in_reward": False}, RLRecipe()),
             ({"estimator": "grpo", "use_kl_in_reward": False}, RLRecipe(kl_placement="none")),
             ({"estimator": "rloo", "use_kl_in_reward": True}, RLRecipe(estimator="rloo", kl_placement="reward")),
             ({}, RLRecipe())]  # a lineage that names neither: nothing to compare
    assert all(materialised_advantages_problem(config, recipe_) is None for config, recipe_ in agree)
    twice = materialised_advantages_problem({"use_kl_in_reward": True}, RLRecipe())
    assert "kl_placement is loss: the KL loss would count it twice" in twice
    assert "would vanish" in materialised_advantages_problem({"use_kl_in_reward": False},
                                                             RLRecipe(kl_placement="reward"))
    assert "estimator gae" in materialised_advantages_problem({"estimator": "gae"}, RLRecipe())


@pytest.mark.parametrize("run_config,named", [
    (recipe(estimator="rloo", samples_per_prompt=1), "resources.rl_recipe: estimator rloo compares the responses "
                                                     "of a prompt's group: samples_per_prompt=1 must be >= 2"),
    (recipe(kl_placement="reward", kl_in_reward_coef=0), "set kl_placement: none"),
    (recipe(kl_placement="reward", kl_loss_coef=0.05), "kl_loss_coef set but kl_placement is reward"),
    (recipe(kl_placement="reward", target_kl=0.5), "target_kl set but kl_ctrl is fixed"),
    (recipe(kl_ctrl="adaptive"), "kl_ctrl set but kl_placement is loss (the KL term is a loss term)"),
    (recipe(off_policy_steps=1, old_logprobs="rollout"), "off_policy_steps 1 samples one update behind"),
    (recipe(off_policy_steps=1, estimator="gae"), "the critic's values and returns are on-policy"),
    (recipe(off_policy_steps=1, sample_ahead=True), "sample_ahead with off_policy_steps 1"),
    (recipe(estimator="ppo_magic"), "resources.rl_recipe.estimator='ppo_magic'"),
])
def test_a_bad_recipe_is_refused_in_one_line_naming_its_fields(run_config, named):
    with pytest.raises(RunConfigError) as err:
        check_run_config({"resources": run_config})
    assert named in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize("ops,recipe_fields,named", [
    ({"advantages": {"config": {"dynamic_sampling": True}}}, {"estimator": "reinforce_plus_plus"},
     "ops.advantages.config with resources.rl_recipe: dynamic_sampling drops groups"),
    ({"rollouts": {"config": {"agent": {}}}}, {"estimator": "gae"},
     "resources.rl_recipe.estimator=gae with ops.rollouts.config.agent"),
    ({"rollouts": {"config": {"agent": {}}}}, {"estimator": "remax"},
     "resources.rl_recipe.estimator=remax with ops.rollouts.config.agent"),
    ({"rollouts": {"config": {"policy": "base"}}}, {"sample_ahead": True},
     "resources.rl_recipe.sample_ahead with ops.rollouts.config.policy=base"),
    ({"rewards": {"config": {"rule": "no_such_reward"}}}, {}, "ops.rewards.config.rule"),
])
def test_a_stage_config_the_recipe_cannot_run_is_refused_naming_both(ops, recipe_fields, named):
    with pytest.raises(RunConfigError) as err:
        check_run_config({"ops": ops, "resources": recipe(**recipe_fields)})
    assert named in str(err.value), str(err.value)


@pytest.mark.parametrize("asset,old,value,new", [
    ("advantages", "kl_coef", 0.001, "resources.rl_recipe.kl_in_reward_coef"),
    ("policy_checkpoint", "kl_coef", 0.01, "resources.rl_recipe.kl_loss_coef"),
    ("policy_checkpoint", "use_kl_in_reward", True, "resources.rl_recipe.kl_placement"),
    ("advantages", "estimator", "rloo", "resources.rl_recipe.estimator"),
    ("policy_checkpoint", "critic", True, "resources.rl_recipe.estimator: gae"),
    ("rollouts", "samples_per_prompt", 4, "resources.rl_recipe.samples_per_prompt"),
    ("rollouts", "greedy_baseline", True, "resources.rl_recipe.estimator: remax"),
    ("rollouts", "off_policy_steps", 1, "resources.rl_recipe.off_policy_steps"),
])
def test_old_field_names_are_refused_with_their_new_place(asset, old, value, new):
    """A field that moved to the recipe, given under its old name: one line naming the new place, for every path
    that reads a stage's config (the up-front check here; `batchrl run` and the launchpad below)."""
    with pytest.raises(RunConfigError) as err:
        check_run_config({"ops": {asset: {"config": {old: value}}}})
    line = str(err.value)
    assert f"ops.{asset}.config: {old}={value!r} moved from ops.{asset}.config to the RL recipe: set {new}" in line
    assert "\n" not in line


def test_config_error_stops_the_run_before_any_asset(tmp_path):
    with dg.DagsterInstance.local_temp(str(tmp_path)) as instance:
        with pytest.raises(RunConfigError, match="samples_per_prompt=1 must be >= 2"):
            run_assets(local_resources(str(tmp_path / "s")), instance, None,
                       {"resources": recipe(estimator="rloo", samples_per_prompt=1)})
        assert instance.get_latest_materialization_event(dg.AssetKey("prompts")) is None


def test_unknown_names_are_refused_by_the_config_schema(tmp_path):
    """Allowed names come from the registries: Dagster's own config check refuses others at launch."""
    from batchrl.definitions import build_definitions

    job = build_definitions(local_resources(str(tmp_path / "s"))).resolve_implicit_global_asset_job_def()
    with dg.DagsterInstance.local_temp(str(tmp_path)) as instance:
        for run_config, field in ((recipe(estimator="ppo_magic"), "estimator"), (recipe(kl_penalty="k9"), "kl_penalty"),
                                  ({"ops": {"policy_checkpoint": {"config": {"policy_loss": "nope"}}}}, "policy_loss")):
            config = run_config if "ops" in run_config else {"resources": run_config}
            with pytest.raises(dg.DagsterInvalidConfigError, match=field):
                job.execute_in_process(instance=instance, run_config=config)


def test_valid_combinations_pass():
    check_run_config({"resources": recipe(estimator="remax")})  # the greedy baseline follows the estimator
    check_run_config({"resources": recipe(estimator="gae")}, ["advantages"])  # so does the critic
    check_run_config({"resources": recipe(kl_placement="reward", kl_ctrl="adaptive", target_kl=0.05)})
    check_run_config({"resources": recipe(kl_placement="none")})
    check_run_config({"ops": {"advantages": {"config": {"dynamic_sampling": True}}},
                      "resources": recipe(estimator="rloo")})
