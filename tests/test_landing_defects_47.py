"""Issue 47 items 2, 5 and 6: a team's landing (``BATCHRL_LANDING``) covers every input location and never falls
back to the shipped samples; a base model from a path needs no log drops; a missing landing location is one line
naming the path and the asset, exit 2 before anything runs, and only for the selected assets."""
from __future__ import annotations

import re
import shutil

import dagster as dg
import pytest
from pipeline_helpers import latest_metadata, local_resources, run_assets

from batchrl.cli.main import main
from batchrl.resources import LandingResource, StorageResource
from batchrl.resources.environments import RESOURCES_BY_ENV, environment_resources
from batchrl.resources.landing import LAYOUT, SAMPLE_DATA, LandingInputMissing, check_landing_inputs
from batchrl.runs.execute import selected_job

DROP_PATH = ["raw_logs", "cleaned_logs", "validated_preferences", "preference_window", "base_model"]
DPO_PATH = DROP_PATH + ["dpo_pairs", "reference_logprobs", "dpo_checkpoint"]
TINY = {"base_model": {"config": {"hidden_size": 64, "intermediate_size": 128, "num_layers": 1}}}


def _team_landing(tmp_path, *locations: str) -> str:
    """A team's landing holding only ``locations`` (copies of the shipped samples' files)."""
    root = tmp_path / "team"
    root.mkdir()
    for location in locations:
        shutil.copytree(f"{SAMPLE_DATA}/{LAYOUT[location]}", root / LAYOUT[location])
    return str(root)


def _failure_message(result: dg.ExecuteInProcessResult) -> str:
    failures = [e for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE]
    assert failures, "the run did not fail"
    return failures[0].step_failure_data.error.message


def test_batchrl_landing_puts_every_location_under_the_team_folder(tmp_path, monkeypatch):
    """Item 2: feedback/ followed the samples; every location of the resource now follows the override."""
    monkeypatch.setenv("BATCHRL_LANDING", str(tmp_path / "team") + "/")
    assert set(LandingResource.model_fields) - {"storage_options"} == set(LAYOUT)  # a new location joins LAYOUT
    for env, resources in RESOURCES_BY_ENV.items():
        landing = resources()["landing"]
        assert {loc: getattr(landing, loc) for loc in LAYOUT} == {
            loc: f"{tmp_path}/team/{relative}" for loc, relative in LAYOUT.items()}, env


def test_feedback_logs_of_a_team_landing_without_feedback_fails_naming_it(tmp_path, monkeypatch):
    """Item 2: with the override and no feedback/ folder, feedback_logs read the shipped samples (140 rows)."""
    monkeypatch.setenv("BATCHRL_LANDING", _team_landing(tmp_path, "preferences"))
    landing = environment_resources("local")["landing"]
    (tmp_path / "home").mkdir()
    with dg.DagsterInstance.local_temp(str(tmp_path / "home")) as instance:
        result = run_assets(local_resources(str(tmp_path / "s"), landing), instance, ["feedback_logs"])
        assert not result.success
        message = _failure_message(result)
        assert f"feedback_logs reads landing.feedback = {tmp_path}/team/feedback: nothing there" in message
        assert "\n" not in message.strip() and "Traceback" not in message


@pytest.fixture
def run_cli(tmp_path, monkeypatch, capsys):
    """``batchrl run --select SELECT`` on the team landing ``landing``, in a fresh home: (exit status, stderr)."""
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("BATCHRL_STORAGE", str(tmp_path / "storage"))
    monkeypatch.setenv("BATCHRL_ENV", "local")
    monkeypatch.delenv("BATCHRL_PROFILE", raising=False)

    def run(landing: str, select: str) -> tuple[int, str]:
        monkeypatch.setenv("BATCHRL_LANDING", landing)
        code = main(["run", "--select", select, "--concurrent-steps", "1"])
        err = capsys.readouterr().err
        with dg.DagsterInstance.from_config(str(tmp_path / "home")) as instance:
            assert not instance.get_runs(), "a run started although an input is missing"
        return code, err

    return run


@pytest.mark.parametrize("select, location", [("scored_logs", "scored"), ("prompts", "prompts"),
                                              ("feedback_logs,kto_checkpoint", "feedback")])
def test_batchrl_run_refuses_a_missing_landing_location_before_anything_runs(run_cli, tmp_path, select, location):
    """Item 6: a raw FileNotFoundError traceback (exit 1) after other steps ran; now one line, exit 2."""
    code, err = run_cli(_team_landing(tmp_path, "preferences"), select)
    asset = select.split(",")[0]
    assert code == 2, err
    assert f"{asset} reads landing.{location} = {tmp_path}/team/{LAYOUT[location]}: nothing there" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_only_the_selected_assets_inputs_are_needed(tmp_path, monkeypatch):
    """Item 6: the DPO path needs no prompts file (nor scored/feedback logs); the whole graph names each missing."""
    monkeypatch.setenv("BATCHRL_LANDING", _team_landing(tmp_path, "preferences"))
    from batchrl.definitions import build_definitions

    defs = build_definitions(environment_resources("local"))
    check_landing_inputs(defs, [selected_job(defs, DPO_PATH)])
    with pytest.raises(LandingInputMissing) as refused:
        check_landing_inputs(defs, [selected_job(defs, None)])
    named = re.findall(r"(\w+) reads landing\.", str(refused.value))
    assert named == ["evaluation", "feedback_logs", "prompts", "scored_logs"]


def test_tiny_base_model_of_a_dpo_run_builds_from_the_window_without_prompts(tmp_path, monkeypatch):
    """Items 5/6: base_model required the prompts ("prompts has no materialisation") on a DPO-only landing."""
    monkeypatch.setenv("BATCHRL_LANDING", _team_landing(tmp_path, "preferences"))
    root = str(tmp_path / "s")
    (tmp_path / "home").mkdir()
    with dg.DagsterInstance.local_temp(str(tmp_path / "home")) as instance:
        result = run_assets(local_resources(root, environment_resources("local")["landing"]), instance, DROP_PATH,
                            {"ops": TINY})
        assert result.success
        lineage = _lineage(instance, root, "base_model")
        assert set(lineage["inputs"]) == {"preference_window"}


def _lineage(instance: dg.DagsterInstance, root: str, asset: str) -> dict:
    meta = latest_metadata(instance, asset)
    return StorageResource(root=root).read_lineage({"asset": asset, "uri": meta["uri"],
                                                    "data_version": meta["data_version"]})


@pytest.mark.parametrize("location, selection, ops", [
    ("feedback", ["feedback_logs", "base_model", "kto_checkpoint"],
     {"kto_checkpoint": {"config": {"epochs": 1, "max_rows": 16}}}),
    ("scored", ["scored_logs", "base_model", "offline_policy_checkpoint"],
     {"offline_policy_checkpoint": {"config": {"micro_batch_size": 16, "max_rows": 16}}}),
])
def test_a_base_model_from_a_path_trains_a_team_without_log_drops(tmp_path, monkeypatch, arith_job_inputs, location,
                                                                  selection, ops):
    """Item 5: only thumbs / only scored logs, model_path set: base_model needed preference_window's materialisation."""
    monkeypatch.setenv("BATCHRL_LANDING", _team_landing(tmp_path, location))
    root = str(tmp_path / "s")
    ops = {**ops, "base_model": {"config": {"model_path": arith_job_inputs["model_path"]}}}
    (tmp_path / "home").mkdir()
    with dg.DagsterInstance.local_temp(str(tmp_path / "home")) as instance:
        result = run_assets(local_resources(root, environment_resources("local")["landing"]), instance, selection,
                            {"ops": ops})
        assert result.success
        assert _lineage(instance, root, "base_model")["inputs"] == {}  # a model from a path reads no data
        assert instance.get_latest_materialization_event(dg.AssetKey(selection[-1])) is not None
