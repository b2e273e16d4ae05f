"""The RL recipe (``resources.rl_recipe``, issue 50): one model of what several RL stages read, each stage taking its
part. The refusals (bad combinations, old names) through the up-front check, `batchrl run` and the launchpad are
in test_rl_choices.py and test_config_defects_47.py; the stages running with it in the RL pipeline tests."""
from __future__ import annotations

import pandas as pd
import pytest

from batchrl.assets.rollout_prefetch import NEXT_ROLLOUTS_SEED_TAG, PROMPTS_FILE, sample_ahead_request
from batchrl.assets.stage_configs import AdvantageConfig, PolicyRunConfig, advantage_settings, policy_config
from batchrl.common.run_config_error import RunConfigError
from batchrl.resources import RolloutEngineResource, StorageResource, TrainerLauncherResource
from batchrl.resources.artifacts import Artifact
from batchrl.resources.rl_recipe import RLRecipe


@pytest.mark.parametrize("placement, loss_coef, in_reward", [("loss", 0.05, False), ("reward", 0.0, True),
                                                             ("none", 0.0, False)])
def test_each_stage_takes_the_kl_where_the_recipe_places_it(placement, loss_coef, in_reward):
    """One switch: the update's KL loss weight and the advantages' KL in the reward follow ``kl_placement``, so the
    term is never in both places nor silently in neither."""
    recipe = RLRecipe(kl_placement=placement, **({"kl_loss_coef": 0.05} if placement == "loss" else {}))
    update = policy_config(PolicyRunConfig(), recipe)
    settings = advantage_settings(AdvantageConfig(), recipe)
    assert update.kl_loss_coef == loss_coef and settings.use_kl_in_reward is in_reward
    assert settings.kl_in_reward_coef == 0.001 and update.kl_loss_type == "low_var_kl"  # the recipe's defaults


@pytest.mark.parametrize("estimator, greedy, critic", [("grpo", False, False), ("remax", True, False),
                                                       ("gae", False, True)])
def test_the_baselines_follow_the_estimator(estimator, greedy, critic):
    recipe = RLRecipe(estimator=estimator)
    assert recipe.rollout_part()["greedy_baseline"] is greedy
    update = policy_config(PolicyRunConfig(), recipe)
    assert (update.adv_estimator, update.critic) == (estimator, critic)
    assert advantage_settings(AdvantageConfig(), recipe).estimator == estimator


def test_a_stage_knob_the_recipe_cannot_run_names_both():
    with pytest.raises(RunConfigError, match="ops.advantages.config with resources.rl_recipe: dynamic_sampling"):
        advantage_settings(AdvantageConfig(dynamic_sampling=True), RLRecipe(estimator="gae"))


def test_the_update_samples_ahead_with_the_recipes_samples_per_prompt(tmp_path):
    """The next iteration's request comes from the recipe (samples per prompt, sampling ahead on), not from the
    rollouts' lineage, which no longer needs to carry them; the prompt sample is still the rollouts' own."""
    storage = StorageResource(root=str(tmp_path / "root"), cache_dir=str(tmp_path / "cache"))
    staging = tmp_path / "staging"
    staging.mkdir()
    pd.DataFrame({"prompt": [f"What is {i} + 1?" for i in range(6)]}).to_parquet(staging / PROMPTS_FILE)
    prompts = storage.publish(str(staging), "prompts", {"config": {}})
    rollouts = Artifact("rollouts", "file:///r", "0" * 16, lineage={"config": {"max_prompts": 4},
                                                                     "inputs": {"prompts": prompts.to_dict()}})
    engine, launcher = RolloutEngineResource(in_subprocess=True), TrainerLauncherResource(backend="worker")
    recipe = RLRecipe(samples_per_prompt=5, sample_ahead=True)
    request, why = sample_ahead_request(storage, engine, launcher, rollouts, rollouts, "policy_checkpoint",
                                        {NEXT_ROLLOUTS_SEED_TAG: "1"}, recipe)
    assert why == "started" and request["n"] == 5 and request["seed"] == 1 and len(request["prompts"]) == 4
    off = sample_ahead_request(storage, engine, launcher, rollouts, rollouts, "policy_checkpoint",
                               {NEXT_ROLLOUTS_SEED_TAG: "1"}, RLRecipe(samples_per_prompt=5))
    assert off == (None, "off")


def test_the_recipe_is_a_resource_of_every_environment_and_profile(monkeypatch):
    """Each environment builds a recipe (the default one); a profile's ``resources.rl_recipe`` sets fields of it,
    its gpu section over its top level, field by field."""
    from batchrl.resources.environments import environment_resources
    from batchrl.resources.profiles import CONFIG_RESOURCES_ENV

    for name in ("BATCHRL_PROFILE", CONFIG_RESOURCES_ENV):
        monkeypatch.delenv(name, raising=False)
    assert environment_resources("local", "")["rl_recipe"] == RLRecipe()
    cpu, gpu = (environment_resources(env, "gsm8k")["rl_recipe"] for env in ("local", "gpu"))
    assert (cpu.samples_per_prompt, cpu.kl_loss_coef, cpu.sample_ahead) == (2, 0.001, False)
    assert (gpu.samples_per_prompt, gpu.kl_loss_coef, gpu.sample_ahead) == (8, 0.001, True)
