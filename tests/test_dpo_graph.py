"""The DPO path's place in the graph: on logged pairs it depends on nothing of the RL branch (so a run with
steps side by side trains it beside rollouts and the reward model); with self-play pairs (`source: self|both`)
`dpo_pairs` has the `rewards` input, chosen by BATCHRL_DPO_SELF_PLAY, the profile, or `batchrl run`'s config."""
from __future__ import annotations

import argparse
import re

import dagster as dg
import pytest

from batchrl.definitions import build_definitions, dpo_takes_self_play_pairs

DPO_PATH = ("dpo_pairs", "reference_logprobs", "dpo_checkpoint")
RL_BRANCH = {"rollouts", "rewards", "advantages", "policy_checkpoint"}


def _upstream(defs: dg.Definitions, asset: str) -> set[str]:
    graph = defs.resolve_asset_graph()
    keys = dg.AssetSelection.assets(asset).upstream().resolve(graph)
    return {k.to_user_string() for k in keys} - {asset}


def test_logged_pairs_dpo_path_needs_nothing_of_the_rl_branch():
    defs = build_definitions(dpo_self_play=False)
    for asset in DPO_PATH:
        assert not _upstream(defs, asset) & RL_BRANCH, asset
    with_self_play = build_definitions(dpo_self_play=True)
    assert {"rewards", "rollouts"} <= _upstream(with_self_play, "dpo_pairs")


@pytest.mark.parametrize("explicit, profile, expected", [
    (None, None, False), ("1", None, True), (None, "real", True),  # the real profile trains on self-play pairs
    ("0", "real", False),
])
def test_self_play_graph_from_the_environment_or_the_profile(monkeypatch, explicit, profile, expected):
    for name, value in (("BATCHRL_DPO_SELF_PLAY", explicit), ("BATCHRL_PROFILE", profile)):
        monkeypatch.delenv(name, raising=False) if value is None else monkeypatch.setenv(name, value)
    assert dpo_takes_self_play_pairs() is expected
    parents = build_definitions().resolve_asset_graph().get(dg.AssetKey("dpo_pairs")).parent_keys
    assert (dg.AssetKey("rewards") in parents) is expected


def test_self_play_source_without_the_rewards_input_fails_before_anything_runs(tmp_path):
    from batchrl.common.run_config_error import RunConfigError
    from batchrl.runs.execute import execute_assets

    defs = build_definitions(dpo_self_play=False)
    with dg.DagsterInstance.ephemeral() as instance:
        for source in ("both", "scored+self"):
            config = {"ops": {"dpo_pairs": {"config": {"source": source}}}}
            with pytest.raises(RunConfigError, match=f"source '{re.escape(source)}'.*BATCHRL_DPO_SELF_PLAY=1"):
                execute_assets(defs, instance, None, config)
        assert not instance.get_runs()


def test_pair_sources_combine_with_plus_and_refuse_unknown_parts(tmp_path):
    from batchrl.assets.dpo import DPOPairsConfig
    from batchrl.common.run_config_error import RunConfigError
    from batchrl.resources.profiles import pair_sources
    from batchrl.runs.execute import execute_assets

    assert pair_sources("both") == pair_sources("self+logged") == ("logged", "self")
    assert pair_sources("scored+logged") == ("logged", "scored")
    for bad in ("logged+bogus", "logged+logged", "", "logged,scored"):
        with pytest.raises(ValueError, match="each part must be one of"):
            DPOPairsConfig(source=bad)
    with dg.DagsterInstance.ephemeral() as instance, pytest.raises(RunConfigError, match="logged\\+bogus"):
        execute_assets(build_definitions(dpo_self_play=False), instance, None,
                       {"ops": {"dpo_pairs": {"config": {"source": "logged+bogus"}}}})


def test_batchrl_run_builds_the_self_play_graph_when_its_config_asks(tmp_path, monkeypatch):
    from batchrl.cli.run_command import _run_config

    # "" = unset; setenv (not delenv, which records nothing when absent) undoes what _run_config sets
    monkeypatch.setenv("BATCHRL_DPO_SELF_PLAY", "")
    monkeypatch.delenv("BATCHRL_PROFILE", raising=False)
    logged, own = tmp_path / "logged.yaml", tmp_path / "self.yaml"
    logged.write_text("ops: {dpo_pairs: {config: {source: logged}}}\n")
    own.write_text("ops: {dpo_pairs: {config: {source: self}}}\n")
    _run_config(argparse.Namespace(profile=None, config=[str(logged)], rl_iterations=None))
    assert not dpo_takes_self_play_pairs()
    _run_config(argparse.Namespace(profile=None, config=[str(own)], rl_iterations=None))
    assert dpo_takes_self_play_pairs()


def test_ratings_reach_dpo_through_config_alone(tmp_path):
    """The seeds' scenario (prompt, response, rating 1-5): scored_logs maps rating -> score, scored_pairs keeps
    best vs worst, dpo_pairs with source scored trains on them — config only, through the assets."""
    import json

    from pipeline_helpers import latest_metadata, local_resources, run_assets

    from batchrl.resources import LandingResource

    scored = tmp_path / "scored"
    scored.mkdir()
    with open(scored / "ratings.jsonl", "w") as f:
        for a in range(1, 7):
            for answer, rating in ((str(2 * a), 5), (str(2 * a + 1), 1), ("no idea", 2)):
                f.write(json.dumps({"prompt": f"What is {a} + {a}?", "response": answer, "rating": rating,
                                    "category": "arith"}) + "\n")
    resources = local_resources(str(tmp_path / "storage"), LandingResource(scored=str(scored)))
    ops = {"base_model": {"config": {"hidden_size": 64, "intermediate_size": 128, "num_layers": 1}},
           "scored_logs": {"config": {"field_mapping": {"rating": "score"}}},
           "scored_pairs": {"config": {"pair_min_margin": 2.0}},
           "dpo_pairs": {"config": {"source": "scored"}}, "dpo_checkpoint": {"config": {"epochs": 1}}}
    selection = ["raw_logs", "cleaned_logs", "validated_preferences", "preference_window", "prompts", "base_model",
                 "scored_logs", "scored_pairs", *DPO_PATH]
    (tmp_path / "home").mkdir()
    with dg.DagsterInstance.local_temp(str(tmp_path / "home")) as instance:
        result = run_assets(resources, instance, selection, {"ops": ops})
        assert result.success
        assert latest_metadata(instance, "scored_pairs")["valid"] == 6
        pairs = latest_metadata(instance, "dpo_pairs")
        assert pairs["source"] == "scored" and pairs["pairs"] == pairs["scored_pairs"] == 6
        latest_metadata(instance, "dpo_checkpoint")
