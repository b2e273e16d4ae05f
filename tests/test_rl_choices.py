"""Estimators, ReMax baselines and KL in the reward through the pipeline, each chosen by the RL recipe
(``resources.rl_recipe``); a recipe refused where a stage reads it (the up-front refusals: test_recipe_refusals.py)."""
from __future__ import annotations

import os

import dagster as dg
import numpy as np
import pandas as pd
import pytest
from pipeline_helpers import TINY_BASE, latest_metadata, local_resources, recipe, run_assets
from pipeline_helpers import UPSTREAM as PIPELINE_UPSTREAM

from batchrl.resources import StorageResource
from batchrl.training.algos import ADV_ESTIMATOR_NEEDS, ADV_ESTIMATORS

UPSTREAM = ["raw_logs", "cleaned_logs", "validated_preferences", "preference_window", "scored_logs", "scored_pairs",
            "prompts", "base_model", "reward_model"]
RL = ["rollouts", "rewards", "advantages", "policy_checkpoint"]
BASE = {"base_model": {"config": {"hidden_size": 64, "intermediate_size": 128, "num_layers": 1}},
        "reward_model": {"config": {"epochs": 1, "max_pairs": 32}}}  # the RM-initialised critic needs a trained head
SMALL_ROLLOUTS = {"max_prompts": 6}
SMALL_RECIPE = {"samples_per_prompt": 3}


@pytest.fixture(scope="module")
def upstream(module_upstream):
    """UPSTREAM: the session's data stages and tiny base model (``BASE``'s, copied), the scored data and the
    reward model trained here."""
    assert BASE["base_model"] == TINY_BASE["ops"]["base_model"]  # the copied upstream's base model
    root, home = module_upstream
    with dg.DagsterInstance.local_temp(home) as instance:
        result = run_assets(local_resources(root), instance, [a for a in UPSTREAM if a not in PIPELINE_UPSTREAM],
                            {"ops": BASE})
        assert result.success
        yield instance, root


def _run_rl(upstream, ops: dict, selection=RL, **recipe_fields):
    """``selection`` with run config ``ops`` and the RL recipe's fields (3 samples a prompt unless given)."""
    instance, root = upstream
    result = run_assets(local_resources(root), instance, selection,
                        {"ops": ops, "resources": recipe(**{**SMALL_RECIPE, **recipe_fields})})
    failures = [str(e.event_specific_data.error) for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    return result, failures


def _lineage(instance, root, asset):
    meta = latest_metadata(instance, asset)
    return StorageResource(root=root).read_lineage({"asset": asset, "uri": meta["uri"],
                                                    "data_version": meta["data_version"]})


def _small_rollouts() -> dict:
    return {"rollouts": {"config": dict(SMALL_ROLLOUTS)}}


@pytest.mark.parametrize("name", sorted(ADV_ESTIMATORS))
def test_every_offered_estimator_runs_in_the_pipeline(upstream, name):
    """Up to the advantages here; the policy update is estimator-agnostic except for the critic, and the
    full loop runs below for remax (baselines) and gae (critic, two iterations)."""
    result, failures = _run_rl(upstream, _small_rollouts(), RL[:3], estimator=name)
    assert result.success, failures
    instance, root = upstream
    meta = latest_metadata(instance, "advantages")
    assert meta["estimator"] == name and meta["samples"] == 18  # greedy rows never reach the batch
    assert meta["adv_abs_mean"] > 0 or name == "remax"  # remax can tie greedy exactly on a tiny model


def test_remax_baselines_are_the_greedy_rewards(upstream):
    result, failures = _run_rl(upstream, _small_rollouts(), estimator="remax")  # greedy baselines: the estimator's
    assert result.success, failures
    instance, root = upstream
    storage = StorageResource(root=root)
    rewards = pd.read_parquet(storage.localize(_ref(instance, "rewards")) + "/rewards.parquet")
    greedy = rewards[rewards["is_greedy_baseline"]]
    assert len(greedy) == 6 and (greedy["sample_index"] == -1).all()
    assert greedy["prompt_index"].is_unique
    batch = pd.read_parquet(storage.localize(_ref(instance, "advantages")) + "/advantages.parquet")
    assert "is_greedy_baseline" not in batch.columns and len(batch) == 18
    baseline = batch["prompt_index"].map(greedy.set_index("prompt_index")["reward"])
    last_token_adv = batch["advantages"].map(lambda a: a[-1])
    np.testing.assert_allclose(last_token_adv, batch["reward"] - baseline, atol=1e-6)
    assert latest_metadata(instance, "policy_checkpoint")["num_samples"] == 18


def _ref(instance, asset):
    meta = latest_metadata(instance, asset)
    return {"asset": asset, "uri": meta["uri"], "data_version": meta["data_version"]}


def test_kl_in_reward_adaptive_controller_carries_over(upstream):
    instance, root = upstream
    kl = {"kl_placement": "reward", "kl_ctrl": "adaptive", "kl_in_reward_coef": 0.05, "target_kl": 1e-4,
          "kl_horizon": 10, "kl_penalty": "k3"}
    states = []
    for seed in (0, 1):
        result, failures = _run_rl(upstream, {"rollouts": {"config": {**SMALL_ROLLOUTS, "seed": seed}}}, **kl)
        assert result.success, failures
        lineage, meta = _lineage(instance, root, "advantages"), latest_metadata(instance, "advantages")
        assert "reference" in lineage["inputs"]
        state = lineage["config"]["kl_ctrl_state"]  # e = clip(KL/target - 1, ±0.2): beta moves towards the target
        assert (state["kl_coef_next"] > state["kl_coef_applied"]) == (meta["kl_in_reward"] > 1e-4)
        states.append((meta["data_version"], lineage))
        policy = latest_metadata(instance, "policy_checkpoint")
        assert "final/pg_loss" in policy and "final/kl_loss" not in policy  # KL is in the reward only
    (first_version, first), (_, second) = states
    assert second["inputs"]["kl_ctrl_from"]["data_version"] == first_version
    assert second["config"]["kl_ctrl_state"]["kl_coef_applied"] == pytest.approx(
        first["config"]["kl_ctrl_state"]["kl_coef_next"])
    assert latest_metadata(instance, "advantages")["kl_in_reward"] > 1e-4  # sampled by the updated policy


@pytest.mark.parametrize("policy", ["base", "latest"])
def test_kl_in_reward_lowers_the_token_rewards_by_beta_kl(upstream, policy):
    """REINFORCE++ returns at token 0 are the sum of the token rewards: reward - beta * sum_t |log-ratio_t|."""
    instance, root = upstream
    result, failures = _run_rl(upstream, {"rollouts": {"config": {**SMALL_ROLLOUTS, "policy": policy}}},
                               ["rollouts", "rewards", "advantages"], estimator="reinforce_plus_plus",
                               kl_placement="reward", kl_in_reward_coef=0.5, kl_penalty="abs")
    assert result.success, failures
    batch = pd.read_parquet(StorageResource(root=root).localize(_ref(instance, "advantages")) + "/advantages.parquet")
    penalty = batch["reward"] - batch["returns"].map(lambda r: r[0])
    kl = latest_metadata(instance, "advantages")["kl_in_reward"]
    assert (penalty >= -1e-6).all()
    if policy == "base":  # the sampling policy is the reference: engine and reference log-probs agree
        assert kl < 1e-3 and penalty.max() < 1e-2
    else:
        assert kl > 1e-3 and penalty.mean() > 0.5 * kl


def test_policy_refuses_advantages_materialised_with_another_recipe(upstream):
    """The advantages a policy update reads may come from an earlier run with another recipe: their lineage is
    compared with the recipe the update reads (the KL's place, the estimator) before it trains."""
    _run_rl(upstream, _small_rollouts(), ["rollouts", "rewards", "advantages"])  # the default: KL as a loss
    for recipe_fields, refusal in [({"kl_placement": "reward"}, "the KL term would vanish"),
                                   ({"estimator": "rloo"}, "computed with estimator grpo")]:
        result, failures = _run_rl(upstream, {}, ["policy_checkpoint"], **recipe_fields)
        assert not result.success and refusal in " ".join(failures), failures
        assert "rematerialise advantages with this recipe" in " ".join(failures)


def test_a_run_launched_from_the_ui_meets_the_recipe_where_its_stages_read_it(upstream):
    """A run launched from the UI skips `batchrl run`'s and execute_assets' check: the recipe is validated when
    Dagster builds the ``rl_recipe`` resource for the first RL step, and a stage's config is refused (an old name
    naming its new place) when the stage builds it, before it samples anything."""
    from batchrl.definitions import build_definitions
    from batchrl.runs.execute import selected_job

    instance, root = upstream
    defs = build_definitions(local_resources(root), dpo_self_play=False)
    for run_config, named in [
        ({"resources": recipe(estimator="rloo", samples_per_prompt=1)}, "samples_per_prompt=1 must be >= 2"),
        ({"ops": {"rollouts": {"config": {"samples_per_prompt": 4}}}}, "set resources.rl_recipe.samples_per_prompt"),
    ]:
        before = instance.get_latest_materialization_event(dg.AssetKey("rollouts"))
        result = selected_job(defs, RL[:3]).execute_in_process(instance=instance, run_config=run_config,
                                                               raise_on_error=False)
        # the recipe fails its init (in process: at the run's start, step None; a step process: its first step's)
        failed = {e.step_key: str(e.event_specific_data.error) for e in result.all_events
                  if e.event_type_value in ("STEP_FAILURE", "RESOURCE_INIT_FAILURE")}
        assert set(failed) <= {None, "rollouts"} and named in " ".join(failed.values()), failed
        assert instance.get_latest_materialization_event(dg.AssetKey("rollouts")) == before


def test_the_critic_is_its_own_versioned_checkpoint_carried_to_the_next_iteration(upstream):
    instance, root = upstream
    ops = _small_rollouts()
    versions = []
    for seed in (0, 1):
        ops["rollouts"]["config"]["seed"] = seed
        result, failures = _run_rl(upstream, ops, estimator="gae")  # the critic follows the estimator
        assert result.success, failures
        policy = latest_metadata(instance, "policy_checkpoint")
        critic = {"asset": "critic_checkpoint", "uri": policy["critic_checkpoint_uri"],
                  "data_version": policy["critic_checkpoint_data_version"]}
        lineage = StorageResource(root=root).read_lineage(critic)
        assert lineage["inputs"]["advantages"]["data_version"] == latest_metadata(instance, "advantages")["data_version"]
        assert policy["critic_value_loss_first"] > 0 and 0 <= policy["critic_vf_clipfrac"] <= 1
        versions.append((critic, _lineage(instance, root, "advantages")["inputs"]["critic"]))
    (first_critic, _), (second_critic, second_valued_with) = versions
    assert second_valued_with == first_critic  # iteration 2 valued its samples with iteration 1's critic
    assert lineage["inputs"]["critic"] == first_critic and second_critic != first_critic


def test_rewards_route_by_data_source_through_the_pipeline(upstream, tmp_path):
    """Prompt fields (data_source, tests) reach the rewards; each source gets its own verifier."""
    import json

    from batchrl.resources import LandingResource

    instance, root = upstream
    rows = [{"id": f"g{i}", "prompt": f"Compute {i} + 2. Answer with a number.", "answer": f"... #### {i + 2}",
             "data_source": "openai/gsm8k"} for i in range(3)]
    rows += [{"id": f"c{i}", "prompt": f"Write add{i}(a, b).", "data_source": "code",
              "tests": [f"assert add{i}(1, 2) == 3"]} for i in range(2)]
    rows += [{"id": "m0", "prompt": "Compute 1 + 1. Answer with a number.", "answer": "2"}]  # default route
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ops = {"rewards": {"config": {"rule": "arith_exact", "custom": {"gsm8k": "gsm8k_flexible", "code": "code_exec"},
                                  "route_by": "data_source", "weights": {"rule": 1.0},
                                  "routing": {"openai/gsm8k": {"gsm8k": 1.0}, "code": {"code": 1.0}}}}}
    resources = local_resources(root, landing=LandingResource(prompts=str(path)))
    try:
        result = run_assets(resources, instance, ["prompts", "rollouts", "rewards"],
                            {"ops": ops, "resources": recipe(samples_per_prompt=2)})
        assert result.success
        scored = pd.read_parquet(StorageResource(root=root).localize(_ref(instance, "rewards")) + "/rewards.parquet")
    finally:  # the other tests use the shipped prompts
        assert run_assets(local_resources(root), instance, ["prompts"]).success
    assert len(scored) == 12 and set(scored["data_source"].dropna()) == {"openai/gsm8k", "code"}
    by_source = scored["data_source"].fillna("default")
    for source, column in (("openai/gsm8k", "gsm8k"), ("code", "code"), ("default", "rule")):
        part = scored[by_source == source]
        np.testing.assert_allclose(part["reward"], part[column])
    for _, row in scored[by_source == "code"].iterrows():  # each row carries its own prompt's tests
        assert json.loads(row["tests"]) == [f"assert add{row['prompt_id'][1]}(1, 2) == 3"]


def _verl_rows():
    instruction = " Let's think step by step and output the final answer after '####'."
    rows = [{"data_source": "openai/gsm8k", "ability": "math",
             "prompt": [{"role": "user", "content": f"Tom has {i} apples and buys 2 more. How many?{instruction}"}],
             "reward_model": {"style": "rule", "ground_truth": str(i + 2)},
             "extra_info": {"split": "train", "index": i}} for i in range(3)]
    rows += [{"data_source": "lighteval/MATH", "ability": "math",
              "prompt": [{"role": "user", "content": "Simplify 2/4. Put the answer in \\boxed{}."}],
              "reward_model": {"style": "rule", "ground_truth": "\\frac{1}{2}"},
              "extra_info": {"split": "train", "index": 3}}]
    return rows


def test_verl_parquet_prompts_run_through_rollouts_and_rewards_routed_by_data_source(upstream, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from batchrl.resources import LandingResource

    instance, root = upstream
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(_verl_rows()), path)
    ops = {"prompts": {"config": {"field_mapping": {"reward_model.ground_truth": "answer"}}},
           "rewards": {"config": {"rule": "format_final_mark", "custom": {"gsm8k": "gsm8k_strict", "math": "math_strict"},
                                  "route_by": "data_source", "weights": {"rule": 1.0},
                                  "routing": {"openai/gsm8k": {"gsm8k": 1.0}, "lighteval/MATH": {"math": 1.0}}}}}
    resources = local_resources(root, landing=LandingResource(prompts=str(path)))
    try:
        result = run_assets(resources, instance, ["prompts", "rollouts", "rewards"],
                            {"ops": ops, "resources": recipe(samples_per_prompt=2)})
        assert result.success
        storage = StorageResource(root=root)
        table = pd.read_parquet(storage.localize(_ref(instance, "prompts")) + "/prompts.parquet")
        scored = pd.read_parquet(storage.localize(_ref(instance, "rewards")) + "/rewards.parquet")
    finally:
        assert run_assets(local_resources(root), instance, ["prompts"]).success
    assert table["answer"].tolist() == ["2", "3", "4", "\\frac{1}{2}"]
    assert table["prompt"][0].startswith("Tom has 0 apples") and table["data_source"][3] == "lighteval/MATH"
    assert len(scored) == 8
    gsm8k, math = scored[scored["data_source"] == "openai/gsm8k"], scored[scored["data_source"] == "lighteval/MATH"]
    np.testing.assert_allclose(gsm8k["reward"], gsm8k["gsm8k"])
    np.testing.assert_allclose(math["reward"], math["math"])


def test_prompt_files_map_fields_and_refuse_what_they_cannot_carry(tmp_path):
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from batchrl.training.data.prompts import PromptFileError, load_prompts

    gsm8k = tmp_path / "gsm8k.jsonl"
    gsm8k.write_text(json.dumps({"question": "Tom has 3 apples...", "answer": "3 + 2 = 5\n#### 5"}) + "\n")
    table = load_prompts(str(gsm8k), mapping={"question": "prompt"})
    assert table[["prompt", "answer"]].values.tolist() == [["Tom has 3 apples...", "3 + 2 = 5\n#### 5"]]
    rows = _verl_rows()
    rows[2]["prompt"] = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "bad.parquet")
    with pytest.raises(PromptFileError, match=r"bad.parquet: row 3: field 'prompt\[1\].role' is 'assistant'"):
        load_prompts(str(tmp_path / "bad.parquet"), mapping={"reward_model.ground_truth": "answer"})
    no_prompt = tmp_path / "no_prompt.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "q", "answer": "1"}]), no_prompt)
    with pytest.raises(PromptFileError, match="no_prompt.parquet: row 1: field 'prompt' must be a non-empty string"):
        load_prompts(str(no_prompt))
    assert load_prompts(str(no_prompt), mapping={"question": "prompt"})["prompt"].tolist() == ["q"]


def test_a_new_critic_can_start_from_the_reward_model(upstream):
    instance, root = upstream
    ops = {"rollouts": {"config": {**SMALL_ROLLOUTS, "policy": "base"}},
           "advantages": {"config": {"critic_init": "reward_model"}}}
    result, failures = _run_rl(upstream, ops, RL[:3], estimator="gae")
    assert result.success, failures
    critic = _lineage(instance, root, "advantages")["inputs"]["critic"]
    assert critic["data_version"] == latest_metadata(instance, "reward_model")["data_version"]
    batch = pd.read_parquet(StorageResource(root=root).localize(_ref(instance, "advantages")) + "/advantages.parquet")
    assert np.abs(np.concatenate(batch["values"].tolist())).max() > 0  # the RM head, not a zero head


def test_config_choices_are_the_registered_functions_and_need_no_torch(arith_model, tmp_path):
    """Run configs choose from ``algos.names`` (torch-free: the definitions load without torch, which took
    ~3-4 s of every run's start on the GPU host); every name there has its registered function with the
    same needs, and a function cannot register under a name run configs do not know."""
    import subprocess
    import sys

    from batchrl.training.algos import POLICY_LOSSES, register_adv_estimator, register_policy_loss
    from batchrl.training.algos.names import POLICY_LOSS_NAMES
    from batchrl.training.trainer.config import PolicyConfig

    assert set(ADV_ESTIMATORS) == set(ADV_ESTIMATOR_NEEDS) and set(POLICY_LOSSES) == set(POLICY_LOSS_NAMES)
    assert set(PolicyConfig.model_fields["adv_estimator"].annotation.__args__) == set(ADV_ESTIMATOR_NEEDS)
    with pytest.raises(ValueError, match="declare it in algos/names.py"):
        register_adv_estimator("grpo_variant", needs=("groups",))
    with pytest.raises(ValueError, match="declare it in algos/names.py"):
        register_adv_estimator("grpo", needs=())  # declared with other needs
    with pytest.raises(ValueError, match="declare it in algos/names.py"):
        register_policy_loss("clip_higher")
    # the definitions, then the data stages and a given base model (lineage records included) run in a
    # Dagster process that has not imported torch; nor does a step that hands its work to a job
    probe = f"""
import sys
import dagster as dg
import batchrl.definitions as d
from pipeline_helpers import local_resources, run_assets
from batchrl.resources import RolloutEngineResource
d.build_definitions()
print([m for m in ("torch", "transformers", "deepspeed") if m in sys.modules])
with dg.DagsterInstance.ephemeral() as instance:
    result = run_assets(local_resources({str(tmp_path / "storage")!r}), instance, UPSTREAM[:-1],
                        {{"ops": {{"base_model": {{"config": {{"model_path": {arith_model!r}}}}}}}}})
    print(result.success, [m for m in ("torch", "transformers", "deepspeed") if m in sys.modules])
    # a stage handed off to a job (rollouts in a Pipes subprocess, as on a GPU host) imports neither the
    # engines, a model library nor torch here
    engine = RolloutEngineResource(in_subprocess=True, max_new_tokens=4)
    result = run_assets(local_resources({str(tmp_path / "storage")!r}, rollout_engine=engine), instance,
                        ["rollouts"], {{"ops": {{"rollouts": {{"config": {SMALL_ROLLOUTS!r}}}}},
                                       "resources": {recipe(**SMALL_RECIPE)!r}}})
    print(result.success, [m for m in ("torch", "batchrl.training.rollout", "transformers", "deepspeed")
                           if m in sys.modules])
"""
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run([sys.executable, "-c", f"UPSTREAM = {UPSTREAM!r}\n" + probe], capture_output=True,
                         text=True, timeout=600, cwd=tests_dir, env={**os.environ, "PYTHONPATH": tests_dir})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[-4:] == ["[]", "True []", "True []", ""], out.stdout[-2000:]


def test_rewards_at_reward_model_weight_zero_need_no_reward_model(upstream_copy, tmp_path):
    """A root of its own without a reward model (the session's data stages and base model, copied): the RL loop
    runs when the mix gives the RM weight 0 (it is neither required nor loaded, nor named in the lineage); a
    non-zero weight fails the rewards step saying what to do."""
    root, home = upstream_copy(tmp_path)
    with dg.DagsterInstance.local_temp(home) as instance:
        assert instance.get_latest_materialization_event(dg.AssetKey("base_model")) is not None
        ops = {"rollouts": {"config": SMALL_ROLLOUTS}}
        result = run_assets(local_resources(root), instance, ["rollouts", "rewards"],
                            {"ops": ops, "resources": recipe(**SMALL_RECIPE)})
        assert result.success
        assert instance.get_latest_materialization_event(dg.AssetKey("reward_model")) is None
        assert "reward_model" not in _lineage(instance, root, "rewards")["inputs"]
        weighted = {"rewards": {"config": {"weights": {"rule": 1.0, "reward_model": 0.5}}}}
        result, failures = _run_rl((instance, root), weighted, ["rewards"])
        assert not result.success and "reward_model has never been materialised" in failures[0]
