"""Helpers of test_pipeline_e2e.py: a copy of the package, a stale-check script, a second RL iteration's
rollouts, a sensor tick, the automation sensor's ticks, the input files of a lineage tree."""
from __future__ import annotations

import json
import os

import dagster as dg
from pipeline_helpers import latest_metadata, local_resources, recipe, run_assets


def copy_package(dest) -> str:
    import shutil

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    shutil.copytree(repo, dest / "batchrl", ignore=shutil.ignore_patterns(
        ".git", ".venv", ".storage", ".dagster_home", ".reproduce", "tests", "bench", "__pycache__", "*.egg-info"))
    return str(dest)


STALE_SCRIPT = """
import json, os, sys
import dagster as dg
import batchrl
from batchrl.definitions import build_definitions
from batchrl.lineage.staleness import code_stale, stale_causes
assert batchrl.__file__.startswith(sys.argv[2]), batchrl.__file__  # the copy, not the checkout
defs = build_definitions()
os.environ["DAGSTER_HOME"] = sys.argv[1]
with dg.DagsterInstance.get() as instance:
    print(json.dumps(sorted(code_stale(stale_causes(defs, instance)))))
"""


def second_iteration_rollouts(instance, root) -> dict:
    """Rollouts sampled from the trained policy_checkpoint (an RL iteration's second step): made by
    test_next_rollouts_sample_from_the_latest_policy_checkpoint when the module runs whole, else here."""
    import duckdb

    with duckdb.connect(os.path.join(root, "catalog.duckdb"), read_only=True) as con:
        rows = con.execute("SELECT uri, data_version, lineage FROM artifacts WHERE asset = 'rollouts'").fetchall()
    for uri, version, lineage in rows:
        if json.loads(lineage)["inputs"]["policy"]["asset"] == "policy_checkpoint":
            return {"uri": uri, "data_version": version}
    assert run_assets(local_resources(root), instance, selection=["rollouts"], run_config={
        "ops": {"rollouts": {"config": {"max_prompts": 4}}}, "resources": recipe(samples_per_prompt=2)}).success
    return latest_metadata(instance, "rollouts")


def sensor_tick(landing, cursor):
    from batchrl.assets.automation import new_logs_sensor

    return new_logs_sensor(dg.build_sensor_context(cursor=cursor, resources={"landing": landing}))


class AutomationTicks:
    """The automation sensor's evaluations (``evaluate_automation_conditions``), one after another with its
    cursor carried, at chosen times: what the daemon does every 30 s while the sensor runs."""

    def __init__(self, defs: dg.Definitions, instance: dg.DagsterInstance):
        self.defs, self.instance, self.cursor = defs, instance, None
        self.keys = sorted(defs.resolve_asset_graph().get_all_asset_keys(), key=str)

    def at(self, when) -> dict[str, set]:
        """asset -> the partitions (None: unpartitioned) requested at ``when`` (a datetime)."""
        result = dg.evaluate_automation_conditions(self.defs, self.instance, cursor=self.cursor, evaluation_time=when)
        self.cursor = result.cursor
        return {key.to_user_string(): set(result.get_requested_partitions(key))
                for key in self.keys if result.get_num_requested(key)}


def next_nightly_tick(after):
    """A minute past the first 03:00 (UTC) after ``after`` (a datetime in UTC): the retrain's tick."""
    import datetime

    tick = after.replace(hour=3, minute=1, second=0, microsecond=0)
    return tick if tick > after else tick + datetime.timedelta(days=1)


def input_files(node: dict):
    yield from node.get("input_files", [])
    for child in node.get("inputs", {}).values():
        yield from input_files(child)
