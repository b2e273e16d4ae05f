"""`batchrl run -c file.yaml` refuses a config it cannot honour before anything runs: one line on stderr naming the
fields, exit status 2 (issue 29: cross-stage errors crashed with a traceback, keys of assets without config were
ignored, config under an asset of a multi-asset step was called an unknown asset)."""
from __future__ import annotations

import dagster as dg
import pytest
import yaml

from batchrl.cli.main import main


@pytest.fixture
def run_cli(tmp_path, monkeypatch, capsys):
    """``batchrl run --select SELECT -c <ops as YAML>`` in this process, in a fresh DAGSTER_HOME and storage root:
    (exit status, stderr)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("BATCHRL_STORAGE", str(tmp_path / "storage"))
    monkeypatch.setenv("BATCHRL_ENV", "local")
    monkeypatch.delenv("BATCHRL_PROFILE", raising=False)
    monkeypatch.setenv("BATCHRL_DPO_SELF_PLAY", "")  # _run_config may set it; setenv records the undo

    def run(select: str, ops: dict, resources: dict | None = None) -> tuple[int, str]:
        path = tmp_path / "run.yaml"
        path.write_text(yaml.safe_dump({"ops": ops, "resources": resources or {}}))
        code = main(["run", "--select", select, "-c", str(path), "--concurrent-steps", "1"])
        err = capsys.readouterr().err
        with dg.DagsterInstance.from_config(str(tmp_path / "home")) as instance:
            assert not instance.get_runs(), "a run started although its config is refused"
        return code, err

    return run


RL = "rollouts,rewards,advantages"


@pytest.mark.parametrize("select, ops, recipe, fields", [
    (RL, {"advantages": {"config": {"dynamic_sampling": True}}}, {"estimator": "remax"},
     ["ops.advantages.config with resources.rl_recipe", "dynamic_sampling", "estimator remax"]),
    (RL, {"rollouts": {"config": {"agent": {}}}}, {"estimator": "gae"},
     ["resources.rl_recipe.estimator=gae with ops.rollouts.config.agent"]),
    (RL, {"rewards": {"config": {"rule": "no_such_reward"}}}, {}, ["ops.rewards.config.rule", "no_such_reward"]),
])
def test_cross_stage_errors_are_one_line_and_exit_2(run_cli, select, ops, recipe, fields):
    """A stage's config against the RL recipe (a -c file's resources.rl_recipe), a reward that does not resolve."""
    code, err = run_cli(select, ops, {"rl_recipe": recipe})
    assert code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("batchrl run: run config in ") and all(field in err for field in fields), err


def test_one_run_config_error_class():
    from batchrl.assets import run_rules
    from batchrl.common import run_config_error
    from batchrl.runs import run_config

    assert run_rules.RunConfigError is run_config.RunConfigError is run_config_error.RunConfigError


@pytest.mark.parametrize("select, ops, named", [
    # scored_logs / scored_pairs take config since issue 31 (the log-drop mapping config; pair_min_margin):
    # a key they do not take, or a value their config refuses, stops the run up front
    ("scored_logs", {"scored_logs": {"config": {"totally_bogus_key": 1}}}, "totally_bogus_key"),
    ("scored_logs", {"scored_logs": {"config": {"kind": "preference"}}}, "kind"),
    ("scored_pairs", {"scored_pairs": {"config": {"pair_min_margin": -1.0}}}, "pair_min_margin"),
])
def test_config_an_asset_cannot_honour_is_an_error(run_cli, select, ops, named):
    code, err = run_cli(select, ops)
    assert code == 2 and named in err, err


def test_config_for_an_asset_without_config_is_an_error():
    """Dagster gives an op without config a permissive schema: its keys would be ignored silently."""
    from batchrl.common.run_config_error import RunConfigError
    from batchrl.runs.run_config import check_config_taken

    @dg.asset
    def plain():
        return 1

    with pytest.raises(RunConfigError, match="ops.plain.config: plain takes no config, got k"):
        check_config_taken(dg.Definitions(assets=[plain]), {"ops": {"plain": {"config": {"k": 1}}}})


def test_config_under_an_asset_of_a_multi_asset_step_names_the_step(run_cli):
    code, err = run_cli("*", {"validated_preferences": {"config": {"reject_threshold": 0.5}}})
    assert code == 2, err
    assert "no asset named" not in err and "its config belongs under ops.log_drop" in err, err


def test_config_of_assets_that_take_it_and_the_profiles_still_validate(tmp_path):
    from batchrl.definitions import build_definitions
    from batchrl.resources.profiles import available_profiles, load_profile
    from batchrl.runs.execute import selected_job
    from batchrl.common.run_config_error import RunConfigError
    from batchrl.runs.run_config import validate_plan
    from pipeline_helpers import local_resources

    defs = build_definitions(local_resources(str(tmp_path / "s")), dpo_self_play=True)
    ops = {"log_drop": {"config": {"reject_threshold": 0.5, "pair_min_margin": 1.0}},
           "scored_logs": {"config": {"field_mapping": {"rating": "score"}}},
           "scored_pairs": {"config": {"pair_min_margin": 1.0}},
           "rollouts": {"config": {"max_prompts": 4}}, "advantages": {"config": {"dynamic_sampling": True}}}
    validate_plan(defs, {"ops": ops}, [(selected_job(defs), {"ops": ops})])
    for name in available_profiles():
        for env in ("local", "gpu"):
            profile_ops = load_profile(name, env)["ops"]
            if _parts_not_installed(profile_ops):  # a split GGUF whose packages are not here: named, then the rest
                with pytest.raises(RunConfigError, match=r"gguf_parts: GGUF part \d+ of \d+ .* is not installed"):
                    validate_plan(defs, {"ops": profile_ops}, [(selected_job(defs), {"ops": profile_ops})])
                profile_ops = {**profile_ops, "base_model": {"config": {"model_path": str(tmp_path)}}}
            validate_plan(defs, {"ops": profile_ops}, [(selected_job(defs), {"ops": profile_ops})])


def _parts_not_installed(ops: dict) -> bool:
    import importlib.metadata as md

    parts = ops.get("base_model", {}).get("config", {}).get("gguf_parts") or []
    try:
        [md.distribution(spec.split(":")[0]) for spec in parts]
    except md.PackageNotFoundError:
        return True
    return False


def test_a_long_rl_run_validates_each_distinct_execution_once(tmp_path):
    """1,000 RL iterations differ in their rollouts seed alone: one stands for all (each validated took ~10 ms), while
    executions that differ otherwise are each kept."""
    import argparse

    from batchrl.cli.run_command import _distinct_executions, _plan
    from batchrl.definitions import build_definitions
    from pipeline_helpers import local_resources

    defs = build_definitions(local_resources(str(tmp_path / "s")))
    ops = {"rollouts": {"config": {"max_prompts": 2}}, "evaluation": {"config": {"max_new_tokens": 4}}}
    plan = _plan(defs, argparse.Namespace(select="*"), {"ops": ops}, 1000)
    distinct = _distinct_executions(plan)
    assert len(plan) == 1001  # the first execution, 999 RL iterations, the evaluation
    assert [selection for selection, _ in distinct] == [plan[0][1], plan[1][1], ["evaluation"]]
    assert distinct[1][1] == plan[1][2]  # the RL iteration validated is a real one, its seed included
    seeds = {p[2]["ops"]["rollouts"]["config"]["seed"] for p in plan[1:-1]}
    assert seeds == set(range(1, 1000))
    # a config's rollouts seed starts the numbering: a replicate with seed 5000 shares no iteration's samples
    replicate = {"ops": {**ops, "rollouts": {"config": {"max_prompts": 2, "seed": 5000}}}}
    plan = _plan(defs, argparse.Namespace(select="*"), replicate, 4)
    assert [p[2]["ops"]["rollouts"]["config"]["seed"] for p in plan[:-1]] == [5000, 5001, 5002, 5003]
