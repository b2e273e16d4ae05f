"""Estimators, ReMax baselines and KL in the reward through the pipeline; impossible choices refused
before anything runs."""
from __future__ import annotations

import os

import dagster as dg
import numpy as np
import pandas as pd
import pytest
from pipeline_helpers import latest_metadata, local_resources, run_assets

from batchrl.assets.run_rules import check_run_config
from batchrl.common.run_config_error import RunConfigError
from batchrl.resources import StorageResource
from batchrl.training.algos import ADV_ESTIMATOR_NEEDS, ADV_ESTIMATORS

UPSTREAM = ["raw_logs", "cleaned_logs", "validated_preferences", "preference_window", "scored_logs", "scored_pairs",
            "prompts", "base_model", "reward_model"]
RL = ["rollouts", "rewards", "advantages", "policy_checkpoint"]
BASE = {"base_model": {"config": {"hidden_size": 64, "intermediate_size": 128, "num_layers": 1}},
        "reward_model": {"config": {"epochs": 1}}}
SMALL_ROLLOUTS = {"samples_per_prompt": 3, "max_prompts": 6}


@pytest.fixture(scope="module")
def upstream(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("storage"))
    with dg.DagsterInstance.local_temp(str(tmp_path_factory.mktemp("home"))) as instance:
        result = run_assets(local_resources(root), instance, UPSTREAM, {"ops": BASE})
        assert result.success
        yield instance, root


def _run_rl(upstream, ops: dict, selection=RL):
    instance, root = upstream
    result = run_assets(local_resources(root), instance, selection, {"ops": ops})
    failures = [str(e.event_specific_data.error) for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    return result, failures


def _lineage(instance, root, asset):
    meta = latest_metadata(instance, asset)
    return StorageResource(root=root).read_lineage({"asset": asset, "uri": meta["uri"],
                                                    "data_version": meta["data_version"]})


def _estimator_run_config(name: str) -> dict:
    needs = ADV_ESTIMATOR_NEEDS[name]
    ops = {"rollouts": {"config": {**SMALL_ROLLOUTS, "greedy_baseline": "reward_baselines" in needs}},
           "advantages": {"config": {"estimator": name}},
           "policy_checkpoint": {"config": {"adv_estimator": name, "critic": "values" in needs}}}
    return ops


@pytest.mark.parametrize("name", sorted(ADV_ESTIMATORS))
def test_every_offered_estimator_runs_in_the_pipeline(upstream, name):
    """Up to the advantages here; the policy update is estimator-agnostic except for the critic, and the
    full loop runs below for remax (baselines) and gae (critic, two iterations)."""
    result, failures = _run_rl(upstream, _estimator_run_config(name), RL[:3])
    assert result.success, failures
    instance, root = upstream
    meta = latest_metadata(instance, "advantages")
    assert meta["estimator"] == name and meta["samples"] == 18  # greedy rows never reach the batch
    assert meta["adv_abs_mean"] > 0 or name == "remax"  # remax can tie greedy exactly on a tiny model


def test_remax_baselines_are_the_greedy_rewards(upstream):
    result, failures = _run_rl(upstream, _estimator_run_config("remax"))
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
    ops = {"advantages": {"config": {"use_kl_in_reward": True, "kl_ctrl": "adaptive", "kl_coef": 0.05,
                                     "target_kl": 1e-4, "kl_horizon": 10, "kl_penalty": "k3"}},
           "policy_checkpoint": {"config": {"use_kl_in_reward": True}}}
    states = []
    for seed in (0, 1):
        ops["rollouts"] = {"config": {**SMALL_ROLLOUTS, "seed": seed}}
        result, failures = _run_rl(upstream, ops)
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
    ops = {"rollouts": {"config": {**SMALL_ROLLOUTS, "policy": policy}},
           "advantages": {"config": {"estimator": "reinforce_plus_plus", "use_kl_in_reward": True,
                                     "kl_coef": 0.5, "kl_penalty": "abs"}}}
    result, failures = _run_rl(upstream, ops, ["rollouts", "rewards", "advantages"])
    assert result.success, failures
    batch = pd.read_parquet(StorageResource(root=root).localize(_ref(instance, "advantages")) + "/advantages.parquet")
    penalty = batch["reward"] - batch["returns"].map(lambda r: r[0])
    kl = latest_metadata(instance, "advantages")["kl_in_reward"]
    assert (penalty >= -1e-6).all()
    if policy == "base":  # the sampling policy is the reference: engine and reference log-probs agree
        assert kl < 1e-3 and penalty.max() < 1e-2
    else:
        assert kl > 1e-3 and penalty.mean() > 0.5 * kl


def test_policy_refuses_advantages_without_the_kl_it_expects(upstream):
    _run_rl(upstream, {"rollouts": {"config": SMALL_ROLLOUTS}}, ["rollouts", "rewards", "advantages"])
    result, failures = _run_rl(upstream, {"policy_checkpoint": {"config": {"use_kl_in_reward": True}}},
                               ["policy_checkpoint"])
    assert not result.success and "would silently vanish" in " ".join(failures)


@pytest.mark.parametrize("ops,field", [
    ({"advantages": {"config": {"estimator": "remax"}}}, "ops.rollouts.config.greedy_baseline"),
    ({"advantages": {"config": {"estimator": "rloo"}}, "rollouts": {"config": {"samples_per_prompt": 1}}},
     "ops.rollouts.config.samples_per_prompt"),
    ({"advantages": {"config": {"estimator": "gae"}}}, "ops.policy_checkpoint.config.critic"),
    ({"policy_checkpoint": {"config": {"use_kl_in_reward": True}}}, "ops.advantages.config.use_kl_in_reward"),
    ({"advantages": {"config": {"use_kl_in_reward": True}}}, "ops.policy_checkpoint.config.use_kl_in_reward"),
    ({"advantages": {"config": {"estimator": "rloo"}}, "policy_checkpoint": {"config": {"adv_estimator": "grpo"}}},
     "ops.policy_checkpoint.config.adv_estimator"),
    ({"policy_checkpoint": {"config": {"adv_estimator": "gae"}}}, "ops.policy_checkpoint.config"),
    ({"advantages": {"config": {"use_kl_in_reward": True, "kl_coef": 0}}}, "ops.advantages.config"),
    ({"rewards": {"config": {"rule": "no_such_reward"}}}, "ops.rewards.config.rule"),
])
def test_impossible_combinations_are_config_errors_naming_the_field(ops, field):
    with pytest.raises(RunConfigError) as err:
        check_run_config({"ops": ops})
    assert field in str(err.value)


def test_config_error_stops_the_run_before_any_asset(tmp_path):
    with dg.DagsterInstance.local_temp(str(tmp_path)) as instance:
        with pytest.raises(RunConfigError, match="greedy_baseline"):
            run_assets(local_resources(str(tmp_path / "s")), instance, None,
                       {"ops": {"advantages": {"config": {"estimator": "remax"}}}})
        assert instance.get_latest_materialization_event(dg.AssetKey("prompts")) is None


def test_a_run_launched_from_the_ui_is_checked_by_its_rollouts_step(upstream):
    """A run launched from the UI skips `batchrl run`'s and execute_assets' check: its rollouts step runs the same
    one (the RL rules and, with the code location's graph, the DPO pair source's) before sampling anything."""
    from batchrl.definitions import build_definitions
    from batchrl.runs.execute import selected_job

    instance, root = upstream
    defs = build_definitions(local_resources(root), dpo_self_play=False)
    for selection, ops, named in [
        (RL[:3], {"advantages": {"config": {"estimator": "remax"}}}, "ops.rollouts.config.greedy_baseline"),
        (["rollouts", "dpo_pairs"], {"dpo_pairs": {"config": {"source": "both"}}}, "BATCHRL_DPO_SELF_PLAY=1"),
    ]:
        before = instance.get_latest_materialization_event(dg.AssetKey("rollouts"))
        result = selected_job(defs, selection).execute_in_process(instance=instance, run_config={"ops": ops},
                                                                  raise_on_error=False)
        failed = {e.step_key: str(e.event_specific_data.error) for e in result.all_events
                  if e.event_type_value == "STEP_FAILURE"}
        assert "rollouts" in failed and named in failed["rollouts"], failed
        assert instance.get_latest_materialization_event(dg.AssetKey("rollouts")) == before


def test_unknown_names_are_refused_by_the_config_schema(tmp_path):
    """Allowed names come from the registries: Dagster's own config check refuses others at launch."""
    from batchrl.definitions import build_definitions

    job = build_definitions(local_resources(str(tmp_path / "s"))).resolve_implicit_global_asset_job_def()
    with dg.DagsterInstance.local_temp(str(tmp_path)) as instance:
        for asset, field, value in (("advantages", "estimator", "ppo_magic"), ("advantages", "kl_penalty", "k9"),
                                    ("policy_checkpoint", "policy_loss", "nope")):
            with pytest.raises(dg.DagsterInvalidConfigError, match=field):
                job.execute_in_process(instance=instance, run_config={"ops": {asset: {"config": {field: value}}}})


@pytest.mark.parametrize("materialised, vanishes, twice", [
    (False, "the KL term would vanish", "adds it again as a loss"),  # this run's configs, up front
    (True, "would silently vanish", "would count it twice"),  # the advantages policy_checkpoint reads
])
def test_one_kl_placement_rule_for_configs_and_materialised_advantages(materialised, vanishes, twice):
    from batchrl.assets.run_rules import kl_placement

    # (advantages use_kl_in_reward, policy use_kl_in_reward, policy kl_coef)
    for agree in [(True, True, 0.01), (False, False, 0.01), (True, False, 0.0)]:
        assert kl_placement(*agree, materialised=materialised) is None
    assert vanishes in kl_placement(False, True, 0.0, materialised=materialised)
    assert twice in kl_placement(True, False, 0.01, materialised=materialised)


def test_valid_combinations_pass():
    check_run_config({"ops": {"rollouts": {"config": {"greedy_baseline": True}},
                                 "advantages": {"config": {"estimator": "remax"}}}})
    check_run_config({"ops": {"advantages": {"config": {"estimator": "remax"}}}}, ["advantages"])
    check_run_config({"ops": {"advantages": {"config": {"estimator": "gae"}},
                                 "policy_checkpoint": {"config": {"adv_estimator": "gae", "critic": True}}}})


def test_the_critic_is_its_own_versioned_checkpoint_carried_to_the_next_iteration(upstream):
    instance, root = upstream
    ops = _estimator_run_config("gae")
    versions = []
    for seed in (0, 1):
        ops["rollouts"]["config"]["seed"] = seed
        result, failures = _run_rl(upstream, ops)
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
    ops = {"rollouts": {"config": {"samples_per_prompt": 2}},
           "rewards": {"config": {"rule": "arith_exact", "custom": {"gsm8k": "gsm8k_flexible", "code": "code_exec"},
                                  "route_by": "data_source", "weights": {"rule": 1.0},
                                  "routing": {"openai/gsm8k": {"gsm8k": 1.0}, "code": {"code": 1.0}}}}}
    resources = local_resources(root, landing=LandingResource(prompts=str(path)))
    try:
        result = run_assets(resources, instance, ["prompts", "rollouts", "rewards"], {"ops": ops})
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
           "rollouts": {"config": {"samples_per_prompt": 2}},
           "rewards": {"config": {"rule": "format_final_mark", "custom": {"gsm8k": "gsm8k_strict", "math": "math_strict"},
                                  "route_by": "data_source", "weights": {"rule": 1.0},
                                  "routing": {"openai/gsm8k": {"gsm8k": 1.0}, "lighteval/MATH": {"math": 1.0}}}}}
    resources = local_resources(root, landing=LandingResource(prompts=str(path)))
    try:
        result = run_assets(resources, instance, ["prompts", "rollouts", "rewards"], {"ops": ops})
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
           "advantages": {"config": {"estimator": "gae", "critic_init": "reward_model"}}}
    result, failures = _run_rl(upstream, ops, RL[:3])
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
                        ["rollouts"], {{"ops": {{"rollouts": {{"config": {SMALL_ROLLOUTS!r}}}}}}})
    print(result.success, [m for m in ("torch", "batchrl.training.rollout", "transformers", "deepspeed")
                           if m in sys.modules])
"""
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run([sys.executable, "-c", f"UPSTREAM = {UPSTREAM!r}\n" + probe], capture_output=True,
                         text=True, timeout=600, cwd=tests_dir, env={**os.environ, "PYTHONPATH": tests_dir})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[-4:] == ["[]", "True []", "True []", ""], out.stdout[-2000:]


def test_rewards_at_reward_model_weight_zero_need_no_reward_model(tmp_path):
    """A fresh root without a reward model: the RL loop runs when the mix gives the RM weight 0 (it is neither
    required nor loaded, nor named in the lineage); a non-zero weight fails the rewards step saying what to do."""
    root = str(tmp_path / "storage")
    data = [a for a in UPSTREAM if a not in ("scored_logs", "scored_pairs", "reward_model")]
    (tmp_path / "home").mkdir()
    with dg.DagsterInstance.local_temp(str(tmp_path / "home")) as instance:
        ops = {"base_model": BASE["base_model"], "rollouts": {"config": SMALL_ROLLOUTS}}
        result = run_assets(local_resources(root), instance, data + ["rollouts", "rewards"], {"ops": ops})
        assert result.success
        assert instance.get_latest_materialization_event(dg.AssetKey("reward_model")) is None
        assert "reward_model" not in _lineage(instance, root, "rewards")["inputs"]
        weighted = {"rewards": {"config": {"weights": {"rule": 1.0, "reward_model": 0.5}}}}
        result, failures = _run_rl((instance, root), weighted, ["rewards"])
        assert not result.success and "reward_model has never been materialised" in failures[0]
