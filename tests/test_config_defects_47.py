"""Issue 47's run-config defects (items 3, 7, 9 and 11's config and console part): `-c` files take ``resources:``
as a profile does; cross-stage lengths, the rollout engine and every op's and resource's config are checked before
anything runs, whatever ``--select`` is; each problem is one line naming the key, the value and the rule; a failed
Pipes job's exception reaches the console; every ingest asset prints its counts; the hint audits what was built."""
from __future__ import annotations

import io
import json
import sys

import dagster as dg
import pytest
import yaml

from batchrl.cli.main import main

PROMPT = {"answer": "3", "category": "arith", "prompt": "Compute 3 + 0. Answer with a number."}


@pytest.fixture
def batchrl_run(tmp_path, monkeypatch, capfd):
    """``batchrl run ARGS`` in this process, in a fresh DAGSTER_HOME and storage root: (exit status, stdout,
    stderr, the runs it started)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("BATCHRL_STORAGE", str(tmp_path / "storage"))
    monkeypatch.setenv("BATCHRL_ENV", "local")
    monkeypatch.delenv("BATCHRL_LANDING", raising=False)
    monkeypatch.setenv("BATCHRL_PROFILE", "")  # _run_config sets these; setenv records the undo
    monkeypatch.setenv("BATCHRL_DPO_SELF_PLAY", "")

    def run(*args: str) -> tuple[int, str, str, list]:
        code = main(["run", *args, "--concurrent-steps", "1"])
        out = capfd.readouterr()  # fd level: the asset lines go to a dup of fd 1 (common.log_file)
        with dg.DagsterInstance.from_config(str(tmp_path / "home")) as instance:
            runs = instance.get_runs()
        return code, out.out, out.err, runs

    return run


def _yaml(tmp_path, name: str, content: dict) -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(content))
    return str(path)


def _prompts_file(tmp_path, name: str, rows: int) -> str:
    path = tmp_path / name
    path.write_text("".join(json.dumps({**PROMPT, "id": f"{name}-{i}"}) + "\n" for i in range(rows)))
    return str(path)


def _refused(err: str) -> list[str]:
    """stderr's lines of a refused run config, each checked to be one whole problem."""
    lines = err.strip().splitlines()
    assert lines and all(line.startswith("batchrl run: ") for line in lines), err
    assert "Traceback" not in err and "Expected:" not in err and "pydantic.dev" not in err, err
    return lines


# item 3: `-c` takes resources, as a profile does, and wins over the profile field by field

def test_c_file_resources_apply_and_win_over_the_profile(tmp_path, batchrl_run):
    profile = _yaml(tmp_path, "team.yaml", {"resources": {"landing": {"prompts": _prompts_file(tmp_path, "a.jsonl", 2)}}})
    mine = _yaml(tmp_path, "run.yaml", {"resources": {"landing": {"prompts": _prompts_file(tmp_path, "b.jsonl", 3)}}})
    # Dagster's run-config shape of a resource ({config: {...}}) says the same
    dagster_shaped = _yaml(tmp_path, "dagster.yaml", {
        "resources": {"landing": {"config": {"prompts": _prompts_file(tmp_path, "c.jsonl", 4)}}}})
    shown = {}
    for name, args in (("profile", ["--profile", profile]), ("both", ["--profile", profile, "-c", mine]),
                       ("dagster", ["-c", dagster_shaped])):
        code, out, err, _ = batchrl_run("--select", "prompts", *args)
        assert code == 0, out + err
        shown[name] = next(line for line in out.splitlines() if line.startswith("[") and " prompts " in line)
    assert "rows=2" in shown["profile"] and "rows=3" in shown["both"] and "rows=4" in shown["dagster"], shown


def test_c_file_resources_are_checked_like_a_profiles(tmp_path, batchrl_run):
    bad = _yaml(tmp_path, "run.yaml", {"resources": {"landing": {"promts": "x.jsonl"},
                                                     "rollout_engine": {"max_new_tokens": "many"}}})
    code, _, err, runs = batchrl_run("--select", "prompts", "-c", bad)
    assert code == 2 and not runs, err
    lines = _refused(err)
    assert any("resources.landing.promts='x.jsonl': no such field; did you mean prompts" in line for line in lines), err
    assert any("resources.rollout_engine.max_new_tokens='many'" in line for line in lines), err
    assert all("run.yaml" in line for line in lines), err


# item 7: cross-stage constraints before anything runs

def test_dpo_and_reference_lengths_must_agree_before_anything_runs(tmp_path, batchrl_run):
    config = _yaml(tmp_path, "run.yaml", {"ops": {"dpo_checkpoint": {"config": {"max_length": 128}}}})
    code, _, err, runs = batchrl_run("--select", "dpo_pairs,reference_logprobs,dpo_checkpoint", "-c", config)
    assert code == 2 and not runs, err
    [line] = _refused(err)
    assert "ops.dpo_checkpoint.config.max_length=128" in line and "ops.reference_logprobs.config.max_length=256" in line


def test_a_reference_from_an_earlier_run_is_checked_by_dpo_checkpoint():
    from batchrl.assets.run_rules import reference_mismatch

    assert reference_mismatch(128, 128, materialised=True) is None
    problem = reference_mismatch(256, 128, materialised=True)
    assert "ops.dpo_checkpoint.config.max_length=128" in problem and "reference log-probs' max_length=256" in problem


@pytest.mark.parametrize("run_config, engine, named", [
    ({"ops": {"policy_checkpoint": {"config": {"temperature": 0.7}}}}, {},
     ["ops.policy_checkpoint.config.temperature=0.7", "resources.rollout_engine.temperature=1.0"]),
    ({"resources": {"rl_recipe": {"config": {"old_logprobs": "rollout"}}}}, {"kind": "vllm"},
     ["resources.rl_recipe.old_logprobs='rollout'", "resources.rollout_engine.sampled_logprobs"]),
    ({"resources": {"rl_recipe": {"config": {"off_policy_steps": 1}}}}, {"kind": "vllm"},
     ["resources.rl_recipe.off_policy_steps=1", "resources.rollout_engine.sampled_logprobs"]),
])
def test_what_the_policy_update_takes_from_the_rollout_engine(run_config, engine, named):
    from batchrl.assets.run_rules import check_run_config
    from batchrl.common.run_config_error import RunConfigError
    from batchrl.resources import RolloutEngineResource

    with pytest.raises(RunConfigError) as raised:
        check_run_config(run_config, None, None, {"rollout_engine": RolloutEngineResource(**engine)})
    assert all(name in str(raised.value) for name in named), raised.value
    # vLLM asked for its sampled-token log-probs, the same temperature: nothing to refuse
    if engine:
        check_run_config(run_config, None, None, {"rollout_engine": RolloutEngineResource(**engine,
                                                                                         sampled_logprobs=True)})


def test_a_failed_pipes_jobs_exception_reaches_the_console(tmp_path):
    """The console said only "External execution process failed with code 1"; the cause was in the log file."""
    from batchrl.cli.console import RunProgress

    script = tmp_path / "job.py"
    script.write_text("from dagster_pipes import open_dagster_pipes\n"
                      "with open_dagster_pipes():\n"
                      "    raise ValueError('reference log-probs cover 68 tokens, this run tokenises 60')\n")

    @dg.asset(required_resource_keys={"pipes"})
    def trained(context):  # not annotated: a string annotation (this module's __future__ import) is refused
        return context.resources.pipes.run(command=[sys.executable, str(script)],
                                           context=context).get_materialize_result()

    with dg.DagsterInstance.local_temp(str(tmp_path)) as instance:
        result = dg.materialize([trained], instance=instance, raise_on_error=False,
                                resources={"pipes": dg.PipesSubprocessClient()})
        assert not result.success
        out = io.StringIO()
        progress = RunProgress(instance, result.run_id, {"trained"}, out)
        progress.poll()
    line = out.getvalue()
    assert "FAIL" in line and "ValueError: reference log-probs cover 68 tokens, this run tokenises 60" in line, line


# item 9: the whole config file, every op and resource, whatever --select is

@pytest.mark.parametrize("ops, named", [
    ({"dpo_checkpoint": {"config": {"betta": 0.2}}}, "ops.dpo_checkpoint.config.betta=0.2: no such key; did you mean beta?"),
    ({"reward_model": {"config": {"lr": -1.0}}}, "ops.reward_model.config.lr=-1.0: Input should be greater than 0"),
    ({"advantages": {"config": {"norm_adv_by_std": "maybe"}}}, "ops.advantages.config.norm_adv_by_std='maybe'"),
    ({"policy_checkpoint": {"config": {"kl_coef": 0.01}}}, "ops.policy_checkpoint.config: kl_coef=0.01 moved from "
     "ops.policy_checkpoint.config to the RL recipe: set resources.rl_recipe.kl_loss_coef"),
    ({"dpo_checkpoint": {"config": {"loss_type": "no_such_loss"}}}, "ops.dpo_checkpoint.config.loss_type='no_such_loss'"),
])
def test_config_of_assets_outside_the_selection_is_checked(tmp_path, batchrl_run, ops, named):
    code, _, err, runs = batchrl_run("--select", "prompts", "-c", _yaml(tmp_path, "run.yaml", {"ops": ops}))
    assert code == 2 and not runs, err
    [line] = _refused(err)
    assert line.startswith("batchrl run: run config in ") and named in line, err


def test_every_problem_of_the_file_is_named_on_a_line_of_its_own(tmp_path, batchrl_run):
    ops = {"dpo_checkpoint": {"config": {"lrr": 1.0}}, "reward_model": {"config": {"lr": -1.0}},
           "rollouts": {"config": {"seed": "eight"}}}
    code, _, err, _ = batchrl_run("--select", "prompts", "-c", _yaml(tmp_path, "run.yaml", {"ops": ops}))
    lines = _refused(err)
    assert code == 2 and len(lines) == 3, err
    assert "ops.dpo_checkpoint.config.lrr=1.0" in err and "ops.reward_model.config.lr=-1.0" in err, err
    assert "ops.rollouts.config.seed='eight': expected Int" in err, err


@pytest.mark.parametrize("flag, content, named", [
    ("-c", {"resources": {"rl_recipe": {"estimator": "rloo", "samples_per_prompt": 1}}},
     "resources.rl_recipe: estimator rloo compares the responses of a prompt's group: samples_per_prompt=1 must be"),
    ("--profile", {"resources": {"rl_recipe": {"kl_placement": "reward", "kl_loss_coef": 0.05}}},
     "resources.rl_recipe: kl_loss_coef set but kl_placement is reward"),
    ("--profile", {"ops": {"advantages": {"config": {"kl_coef": 0.001}}}},
     "ops.advantages.config: kl_coef=0.001 moved from ops.advantages.config to the RL recipe: set "
     "resources.rl_recipe.kl_in_reward_coef"),
    ("-c", {"ops": {"rollouts": {"config": {"samples_per_prompt": 4}}}},
     "set resources.rl_recipe.samples_per_prompt"),
])
def test_a_bad_rl_recipe_or_an_old_field_name_exits_2_before_any_asset(tmp_path, batchrl_run, flag, content, named):
    """The RL recipe written once (a profile's or -c file's resources.rl_recipe) is validated when the command
    builds its resources; an old field name in a stage's config is named with its new place: one line, exit 2, no
    run started (whatever --select is)."""
    code, _, err, runs = batchrl_run("--select", "prompts", flag, _yaml(tmp_path, "run.yaml", content))
    assert code == 2 and not runs, err
    [line] = _refused(err)
    assert named in line, err


def test_an_unknown_rollout_engine_in_a_profile_is_refused_before_anything_runs(tmp_path, batchrl_run):
    profile = _yaml(tmp_path, "team.yaml", {"resources": {"rollout_engine": {"kind": "vlm"}}})
    code, _, err, runs = batchrl_run("--select", "prompts", "--profile", profile)
    assert code == 2 and not runs, err
    [line] = _refused(err)
    assert "resources.rollout_engine.kind='vlm': not a rollout engine; known: static, transformers, vllm" in line


def test_the_built_in_engine_names_are_the_registrys():
    from batchrl.runs.resource_rules import BUILT_IN_ENGINES
    from batchrl.training.rollout import ROLLOUT_ENGINES

    assert set(BUILT_IN_ENGINES) <= set(ROLLOUT_ENGINES)


# item 11: the console

@pytest.mark.parametrize("asset", ["feedback_logs", "scored_logs"])
def test_every_ingest_asset_prints_its_counts(asset):
    from batchrl.cli.console import asset_line

    counts = {"rows_in": 140, "valid": 130, "quarantined": 6, "duplicates": 4, "data_version": "0123456789abcdef"}
    line = asset_line(1, 3, asset, 0.5, True, counts)
    assert "rows_in=140 valid=130 quarantined=6 duplicates=4" in " ".join(line.split()), line  # wrapped at 100


def test_the_hint_audits_an_asset_this_run_materialised():
    from batchrl.cli.console import print_run_summary

    def footer(done: list[dict]) -> str:
        out = io.StringIO()
        print_run_summary(done, True, 1.0, None, lambda asset: None, out=out, dagster_home="home")
        return out.getvalue()

    def item(asset: str, ok: bool = True) -> dict:
        return {"asset": asset, "ok": ok, "seconds": 1.0, "metadata": {}}

    dpo_only = footer([item("dpo_pairs"), item("reference_logprobs"), item("dpo_checkpoint")])
    assert "audit dpo_checkpoint" in dpo_only and "policy_checkpoint" not in dpo_only, dpo_only
    assert "audit prompts" in footer([item("prompts"), item("rollouts", ok=False)])
    assert "audit" not in footer([]) and "UI:" in footer([])


def test_a_cause_is_shown_without_module_paths_and_whole_in_the_summary():
    from batchrl.cli.console import _root_cause, print_run_summary

    @dg.asset
    def failing_stage() -> None:
        raise dg.Failure("set the same max_length")

    @dg.asset
    def failing_job() -> None:
        raise ValueError("tokenises 60")

    done = dg.materialize([failing_stage, failing_job], raise_on_error=False)
    # what the console shows of a failed step: its innermost error, without Dagster's module paths
    shown = {event.step_key: _root_cause(event.step_failure_data.error) for event in done.get_step_failure_events()}
    assert shown == {"failing_stage": "set the same max_length",  # a dg.Failure is written for the user
                     "failing_job": "ValueError: tokenises 60"}
    cause = "ops.dpo_checkpoint.config.max_length=128 differs: " + "why " * 60 + "what to do"
    out = io.StringIO()
    print_run_summary([{"asset": "dpo_checkpoint", "ok": False, "seconds": 1.0, "metadata": {}, "error": cause}],
                      False, 1.0, None, lambda asset: None, out=out)
    assert f"dpo_checkpoint failed: {cause}" in out.getvalue()


def test_scientific_notation_without_a_dot_is_a_float(tmp_path):
    """``lr: 1e-5`` (and JSON's ``1e-05``) read as strings under YAML 1.1 and failed the check as "expected Float"
    (found by the GSM8K bench's overrides, 2026-12-05); a string that only looks numeric stays a string."""
    from batchrl.resources.profiles import load_run_file

    path = tmp_path / "c.yaml"
    path.write_text('ops: {policy_checkpoint: {config: {lr: 1e-5, entropy_coef: 1E-03}}, x: {config: {name: "1e-5"}}}\n')
    ops = load_run_file(str(path))["ops"]
    assert ops["policy_checkpoint"]["config"] == {"lr": 1e-05, "entropy_coef": 0.001}
    assert ops["x"]["config"]["name"] == "1e-5"
    path.write_text('{"ops": {"policy_checkpoint": {"config": {"lr": 1e-05}}}}')
    assert load_run_file(str(path))["ops"]["policy_checkpoint"]["config"]["lr"] == 1e-05
