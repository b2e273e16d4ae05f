"""Runs of ``execute_assets`` (what `batchrl run` executes) are recorded as the webserver records the runs it
launches: the code location's origin, the selected assets, the loaded job's snapshot as parent; base_model's
metadata names its published files."""
from __future__ import annotations

import os

import dagster as dg
from pipeline_helpers import latest_metadata, local_resources, run_assets

from batchrl.definitions import build_definitions
from batchrl.runs.launched import CODE_LOCATION, REPOSITORY

SELECTION = ["raw_logs", "cleaned_logs", "validated_preferences", "preference_window", "prompts", "base_model"]


def test_runs_carry_the_code_locations_origin_and_base_model_names_published_files(tmp_path):
    resources = local_resources(str(tmp_path / "s"))
    (tmp_path / "home").mkdir()
    with dg.DagsterInstance.local_temp(str(tmp_path / "home")) as instance:
        assert run_assets(resources, instance, SELECTION).success
        whole = build_definitions(resources).resolve_implicit_global_asset_job_def()
        runs = instance.get_runs()
        assert len(runs) == 3  # one per log drop, then the rest
        for run in runs:
            origin = run.remote_job_origin
            assert (origin.location_name, origin.repository_origin.repository_name, origin.job_name) == \
                (CODE_LOCATION, REPOSITORY, whole.name)
            assert run.job_code_origin.repository_origin.code_pointer.module == CODE_LOCATION
            lineage = instance.get_job_snapshot(run.job_snapshot_id).lineage_snapshot
            assert lineage.parent_snapshot_id == whole.get_job_snapshot_id()  # the loaded job: no version warning
            assert {k.to_user_string() for k in run.asset_selection} in (
                set(SELECTION[:3]), set(SELECTION[3:]))
        tagged = instance.get_runs(dg.RunsFilter(tags={".dagster/repository": f"{REPOSITORY}@{CODE_LOCATION}"}))
        assert len(tagged) == 3  # what the Overview timeline groups runs by
        base = latest_metadata(instance, "base_model")
        assert str(base["path"]) == str(base["uri"]) and os.path.isdir(str(base["path"]))
        for key, name in (("model_file", "model.safetensors"), ("tokenizer_file", "tokenizer.json")):
            assert str(base[key]) == os.path.join(str(base["uri"]), name) and os.path.isfile(str(base[key]))
