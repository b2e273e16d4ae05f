"""Declarative automation of the code location (``assets/automation.py``), evaluated with Dagster's
``evaluate_automation_conditions`` on real ingests: each registered log drop requests exactly its own per-drop
assets; at the 03:00 tick the training stages are requested only when a drop brought new data that passed its
blocking checks; the automation sensor is the only one and is stopped until switched on."""
from __future__ import annotations

import datetime
import json
import os
import shutil

import dagster as dg
from e2e_helpers import AutomationTicks, next_nightly_tick
from pipeline_helpers import local_resources, run_assets

from batchrl.assets.automation import PER_DROP
from batchrl.definitions import build_definitions
from batchrl.resources import LandingResource

DATA = [key.to_user_string() for key in PER_DROP]


def _setup(tmp_path) -> tuple[LandingResource, dict]:
    prefs = tmp_path / "landing" / "preferences"
    shutil.copytree(LandingResource().preferences, prefs)
    landing = LandingResource(preferences=str(prefs))
    (tmp_path / "home").mkdir()
    return landing, local_resources(str(tmp_path / "s"), landing)


def test_a_registered_drop_requests_exactly_its_per_drop_assets_once(tmp_path):
    """~3 s. A drop registered before automation's first evaluation is ingested too (``eager()`` would not)."""
    landing, resources = _setup(tmp_path)
    now = datetime.datetime.now(datetime.timezone.utc)
    with dg.DagsterInstance.local_temp(str(tmp_path / "home")) as instance:
        ticks = AutomationTicks(build_definitions(resources), instance)
        instance.add_dynamic_partitions("log_drops", ["prefs_000.jsonl"])
        assert ticks.at(now) == {name: {"prefs_000.jsonl"} for name in DATA}
        instance.add_dynamic_partitions("log_drops", ["prefs_001.jsonl"])
        assert run_assets(resources, instance, DATA).success  # what the requested runs do
        assert ticks.at(now + datetime.timedelta(minutes=1)) == {}  # ingested: not asked again, nothing else
        instance.add_dynamic_partitions("log_drops", ["prefs_002.jsonl"])
        assert ticks.at(now + datetime.timedelta(minutes=2)) == {name: {"prefs_002.jsonl"} for name in DATA}


def test_the_nightly_tick_retrains_only_on_new_data_that_passed_its_blocking_checks(tmp_path):
    """~8 s. At 03:00 the stages downstream of a new drop are requested in one go (``scored_pairs``: its input
    did not change); no new drop, a new promoted policy (what the last retrain made) or only a drop that failed
    its reject-rate check: nothing."""
    landing, resources = _setup(tmp_path)
    now = datetime.datetime.now(datetime.timezone.utc)
    with dg.DagsterInstance.local_temp(str(tmp_path / "home")) as instance:
        defs = build_definitions(resources)
        ticks = AutomationTicks(defs, instance)
        assert ticks.at(now) == {}  # nothing registered, nothing made
        assert run_assets(resources, instance, DATA).success  # both drops ingested (as the ingest runs do)
        night = next_nightly_tick(now)
        retrain = ticks.at(night)
        training = {key.to_user_string() for key in defs.resolve_asset_graph().get_all_asset_keys()} - set(DATA) - {
            "promoted_policy", "prompts", "scored_logs", "feedback_logs", "scored_pairs"}
        assert retrain == {name: {None} for name in training}
        assert ticks.at(night + datetime.timedelta(minutes=1)) == {}  # requested once
        night = next_nightly_tick(night)
        assert ticks.at(night) == {}  # no new data since
        instance.report_runless_asset_event(dg.AssetMaterialization("promoted_policy"))  # as a retrain promotes
        night = next_nightly_tick(night)
        assert ticks.at(night) == {}  # the loop's back edge is no new input

        with open(os.path.join(landing.preferences, "zz_broken.jsonl"), "w") as f:
            for i in range(60):  # far above the reject threshold: its blocking check fails
                f.write(json.dumps({"prompt": f"q{i}", "chosen": "", "rejected": "x"}) + "\n")
        events = run_assets(resources, instance, DATA).all_events
        checks = {e.event_specific_data.check_name: e.event_specific_data.passed
                  for e in events if e.event_type_value == "ASSET_CHECK_EVALUATION"}
        assert checks == {"nothing_lost": True, "reject_rate_below_threshold": False}  # materialised, gate failed
        night = next_nightly_tick(night)
        assert ticks.at(night) == {}  # the failed drop is no new data

        with open(os.path.join(landing.preferences, "zz_good.jsonl"), "w") as f:
            f.write(json.dumps({"prompt": "What is 2 + 2?", "chosen": "4", "rejected": "5"}) + "\n")
        assert run_assets(resources, instance, DATA).success
        night = next_nightly_tick(night)
        assert ticks.at(night - datetime.timedelta(hours=2)) == {}  # new data waits for the tick
        assert ticks.at(night) == retrain


def test_automation_is_off_until_switched_on():
    """The code location holds exactly two sensors, both stopped by default: the automation sensor covers
    every asset with a condition, so Dagster adds no default automation sensor of its own."""
    defs = build_definitions()
    sensors = {s.name: s for s in defs.get_repository_def().sensor_defs}
    assert set(sensors) == {"new_logs_sensor", "automation_sensor"}
    assert {s.default_status for s in sensors.values()} == {dg.DefaultSensorStatus.STOPPED}
    graph = defs.resolve_asset_graph()
    automated = {key for key in graph.get_all_asset_keys() if graph.get(key).automation_condition}
    assert automated and automated <= sensors["automation_sensor"].asset_selection.resolve(graph)
    assert not defs.get_repository_def().schedule_defs  # the nightly retrain is a condition now
